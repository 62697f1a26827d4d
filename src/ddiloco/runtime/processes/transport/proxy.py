"""A fault-injecting proxy between learners and the syncer: chaos for the wire.

Owns nothing of the algorithm: it forwards zmq multipart frames between learners (which
connect to it as if it were the syncer, with their credentials: it checks them as the
syncer does) and the syncer (to which it connects once per learner, with that learner's
credentials: it holds the run secret, from $DDILOCO_SECRET), and on the way drops, delays
(so reorders), duplicates, truncates and corrupts them at the rates of a :class:`Faults`
spec such as ``"drop=0.02,duplicate=0.02,corrupt=0.01,truncate=0.01,delay=0.05"``
(``drop_parts``: only the answer parts a sharded learner's ranks >= 1 send). Seeded,
so a spec and a seed replay the same decisions for the same traffic.

It also plays the chaos plan's link faults, as the simulated clock models them
(:class:`LinkShaper`): each learner has one link each way; ``link_cut`` makes both carry
nothing for a while (frames are held, in order, and released when the cut ends) and
``link_slow`` divides their bandwidth (``--gbps``, the run's ``network.learner_syncer_gbps``)
by a factor. Commands come from the launcher on stdin (``--control``), one JSON object a
line: ``{"link": 2, "cut_seconds": 5.0}`` or ``{"link": 2, "factor": 4.0, "seconds": 0}``
(0: to the end); a bad one is logged and ignored. Under ``--control`` the proxy forwards
nothing until ``{"open": true}``: the launcher sends it after what is left of each link
fault, so a restarted proxy never lets a cut learner through before its cut is back. Run
by the launcher when ``processes.proxy`` is set or the plan has link faults, or by hand::

    python -m ddiloco.runtime.processes.transport.proxy --listen 127.0.0.1:6000 \
        --target 127.0.0.1:5555 --run-id RUN --faults drop=0.01,corrupt=0.01
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import logging
import math
import os
import queue
import random
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import IO, Any, Generic, TypeVar

import zmq

from ddiloco.config import NetworkConfig
from ddiloco.core.links import Links
from ddiloco.errors import ConfigError, require
from ddiloco.runtime.processes import terminate
from ddiloco.runtime.processes.protocol import AnswerPart
from ddiloco.runtime.processes.transport.auth import (
    Gatekeeper,
    HandshakeWatch,
    Link,
    link_name,
    link_of,
    present,
    serve_plain,
)
from ddiloco.runtime.processes.transport.events import EVENT_PREFIX
from ddiloco.runtime.processes.transport.sockets import Socket, load_secret
from ddiloco.runtime.processes.transport.wire import peek_kind

log = logging.getLogger(__name__)

KINDS = ("drop", "duplicate", "corrupt", "truncate", "delay", "drop_parts")
DEFAULT_GBPS = NetworkConfig().learner_syncer_gbps
MAX_COMMAND_BYTES = 1024
MAX_LINK = 1_000_000
UP, DOWN = "up", "down"  # learner -> syncer, syncer -> learner
T = TypeVar("T")


@dataclass(frozen=True)
class Faults:
    """Per-message probabilities of each fault, and how long a delay lasts."""

    drop: float = 0.0
    duplicate: float = 0.0
    corrupt: float = 0.0
    truncate: float = 0.0
    delay: float = 0.0
    delay_seconds: float = 0.05
    drop_parts: float = 0.0  # of the answer parts a sharded learner's rank >= 1 sends

    def __post_init__(self) -> None:
        for kind in KINDS:
            p = getattr(self, kind)
            require(0.0 <= p <= 1.0, f"processes.proxy.{kind}", p, "a probability in [0, 1]")
        require(
            self.delay_seconds >= 0,
            "processes.proxy.delay_seconds",
            self.delay_seconds,
            "must be >= 0",
        )

    @classmethod
    def parse(cls, spec: str) -> Faults:
        """``"drop=0.02,delay=0.1,delay_seconds=0.2"`` -> Faults."""
        values: dict[str, float] = {}
        names = {f.name for f in dataclasses.fields(cls)}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            key, sep, raw = item.partition("=")
            if not sep or key not in names:
                raise ConfigError("processes.proxy", item, f"expected KEY=VALUE, KEY in {names}")
            try:
                values[key] = float(raw)
            except ValueError:
                raise ConfigError(f"processes.proxy.{key}", raw, "not a number") from None
        return cls(**values)


@dataclass(frozen=True)
class LinkCommand:
    """Cut learner ``link``'s links for ``cut_seconds``, or divide their bandwidth by
    ``factor`` for ``seconds`` (0: to the end)."""

    link: int
    cut_seconds: float | None = None
    factor: float | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class Open:
    """``{"open": true}``: start forwarding (a proxy held under ``--control`` waits for it)."""


OPEN = Open()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _number(data: dict[str, Any], key: str, positive: bool) -> float:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key!r} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise ValueError(f"{key!r} must be finite and {'> 0' if positive else '>= 0'}: {number}")
    return number


def parse_command(raw: bytes | str) -> LinkCommand | Open:
    """One control line -> a :class:`LinkCommand` (or :data:`OPEN`); a ValueError says what is
    wrong with it.
    Plain JSON only (never pickle); unknown keys, NaN/Infinity and booleans are refused."""
    if len(raw) > MAX_COMMAND_BYTES:
        raise ValueError(f"longer than {MAX_COMMAND_BYTES} bytes")
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("nested too deep") from None
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    if data == {"open": True}:
        return OPEN
    link = data.get("link")
    if isinstance(link, bool) or not isinstance(link, int) or not 0 <= link < MAX_LINK:
        raise ValueError(f"'link' must be a learner id in [0, {MAX_LINK}), got {link!r}")
    keys = set(data) - {"link"}
    if keys == {"cut_seconds"}:
        return LinkCommand(link, cut_seconds=_number(data, "cut_seconds", positive=False))
    if keys in ({"factor"}, {"factor", "seconds"}):
        seconds = _number(data, "seconds", positive=False) if "seconds" in data else 0.0
        return LinkCommand(link, factor=_number(data, "factor", positive=True), seconds=seconds)
    raise ValueError(f"expected keys link+cut_seconds or link+factor[+seconds], got {sorted(data)}")


class _Frame(Generic[T]):
    __slots__ = ("done", "item", "nbytes", "ready")

    def __init__(self, ready: float, nbytes: int, item: T) -> None:
        self.ready, self.nbytes, self.item = ready, nbytes, item
        self.done: float | None = None  # when it has gone through the link, once started


class LinkShaper(Generic[T]):
    """Each learner's two links (``up``, ``down``) on the core's link model, which the
    simulated clock's Network uses too (:class:`~ddiloco.core.links.Links`).

    A link carries one frame at a time, in order. ``cut``: nothing starts until the cut ends
    (frames wait, none is dropped; one already going through finishes). ``slow``: a frame
    takes nbytes / (gbps / factor) to go through; after ``seconds`` (0: never) the factor goes
    back to 1, as the simulated clock restores it. At factor 1 nothing is added: frames pass
    at whatever speed the real network has. A frame's start is decided when it reaches the
    head of its link's queue, so a cut begun meanwhile holds it too. Pure bookkeeping on the
    times handed in.
    """

    def __init__(self, gbps: float, counts: Counter[str] | None = None) -> None:
        require(gbps > 0 and math.isfinite(gbps), "proxy.gbps", gbps, "must be > 0")
        self.gbps = gbps
        self.counts: Counter[str] = Counter() if counts is None else counts
        self.model = Links()
        self.cut_until = self.model.cut_until  # (read by tests and counters)
        self.factor = self.model.factor
        self.restores: list[tuple[float, int, int]] = []  # (when, tie, learner): factor -> 1
        self.queues: dict[tuple[str, int], deque[_Frame[T]]] = {}
        self._tie = itertools.count()

    def cut(self, learner: int, now: float, seconds: float) -> None:
        self.model.cut(learner, now + seconds)
        self.counts["link_cut"] += 1

    def slow(self, learner: int, now: float, factor: float, seconds: float) -> None:
        self._restore(now)
        self.model.slow(learner, factor)
        if seconds > 0:
            heapq.heappush(self.restores, (now + seconds, next(self._tie), learner))
        self.counts["link_slow"] += 1

    def apply(self, command: LinkCommand, now: float) -> None:
        if command.cut_seconds is not None:
            self.cut(command.link, now, command.cut_seconds)
        elif command.factor is not None:
            self.slow(command.link, now, command.factor, command.seconds)

    def _restore(self, now: float) -> None:
        while self.restores and self.restores[0][0] <= now:
            self.model.slow(heapq.heappop(self.restores)[2], 1.0)

    def submit(self, learner: int, direction: str, now: float, nbytes: int, item: T) -> bool:
        """Hand a frame to a link at ``now``: True if it may go at once (nothing to emulate),
        else it is queued and :meth:`due` returns it when it has gone through."""
        self._restore(now)
        key = (direction, learner)
        cut = self.model.is_cut(learner, now)
        if (
            not self.queues.get(key)
            and self.model.start(key, now) <= now
            and (self.model.factor_of(learner) <= 1.0)
        ):
            return True
        self.counts["held" if cut else "queued"] += 1
        self.queues.setdefault(key, deque()).append(_Frame(now, nbytes, item))
        return False

    def due(self, now: float) -> list[T]:
        """The frames that have gone through their link by ``now``, each link's in order."""
        self._restore(now)
        out: list[T] = []
        for key, frames in self.queues.items():
            while frames:
                head = frames[0]
                if head.done is None:
                    start = self.model.start(key, head.ready)
                    if start > now:
                        break
                    slowed = self.model.factor_of(key[1]) > 1
                    if slowed:
                        self.counts["slowed"] += 1
                    gbps = self.gbps if slowed else math.inf  # unslowed: the real speed
                    head.done = self.model.carry(key, start, head.nbytes, gbps)
                if head.done > now:
                    break
                out.append(frames.popleft().item)
        for key in [k for k, frames in self.queues.items() if not frames]:
            del self.queues[key]
        return out

    def pending(self) -> int:
        return sum(len(frames) for frames in self.queues.values())


Queued = tuple[Socket, list[bytes]]


class FaultProxy:
    """Forwards learner <-> syncer traffic, injuring it on the way and shaping each learner's
    links as the chaos plan says."""

    def __init__(
        self,
        listen: str,
        target: str,
        faults: Faults,
        seed: int = 0,
        gbps: float = DEFAULT_GBPS,
        *,
        run: str,
        secret: bytes,
        held: bool = False,
    ) -> None:
        self.faults = faults
        self.target = target
        self.run_id = run
        self.secret = secret
        self.rng = random.Random(seed)
        self.ctx: zmq.Context[Socket] = zmq.Context()
        self.gate = Gatekeeper(self.ctx, secret, run, lambda n: link_of(n) is not None)
        self.gate.start()  # before the bind: no handshake goes unchecked
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        serve_plain(self.front)
        self.front.bind(f"tcp://{listen}")
        # per link (learner, rank: core/parts.py), as its handshake named it
        self.routes: dict[Link, bytes] = {}  # its connection to our front
        self.backs: dict[Link, Socket] = {}  # ours to the syncer, with its credentials
        self.back_link: dict[Socket, Link] = {}
        self.watches: dict[Link, HandshakeWatch] = {}  # its back socket's ticket
        self.poller = zmq.Poller()
        self.poller.register(self.front, zmq.POLLIN)
        self.delayed: list[tuple[float, int, Socket, list[bytes], int | None, str]] = []
        self._tie = itertools.count()
        self.counts: Counter[str] = Counter()
        self.links: LinkShaper[Queued] = LinkShaper(gbps, self.counts)
        self.commands: queue.SimpleQueue[LinkCommand | Open | str] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.open = threading.Event()  # forwarding; ``held``: only from an :data:`OPEN` on
        if not held:
            self.open.set()

    def _back(self, link: Link) -> Socket:
        sock = self.backs.get(link)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            present(sock, self.secret, self.run_id, link_name(*link))
            self.watches[link] = HandshakeWatch(sock, self.target)
            sock.connect(f"tcp://{self.target}")
            self.backs[link] = sock
            self.back_link[sock] = link
            self.poller.register(sock, zmq.POLLIN)
        return sock

    def _renew_backs(self) -> None:
        """Replace a back socket whose one-time ticket is spent (the syncer restarted, or the
        connection broke): zmq would reconnect it with the spent ticket, refused for ever."""
        for link, watch in list(self.watches.items()):
            refused = watch.poll()
            if refused is not None:
                log.error("proxy: the syncer at %s", refused)
            if watch.renew or refused is not None:
                watch.close()
                del self.watches[link]
                sock = self.backs.pop(link)
                del self.back_link[sock]
                self.poller.unregister(sock)
                sock.close(0)
                self.counts["renewed"] += 1

    def injure(self, parts: list[bytes]) -> list[list[bytes]]:
        """What to send for one message: nothing, it, it twice, or a damaged copy."""
        f, rng = self.faults, self.rng
        self.counts["messages"] += 1
        if rng.random() < f.drop:
            self.counts["dropped"] += 1
            return []
        parts = list(parts)
        if rng.random() < f.corrupt:
            i = rng.randrange(len(parts))
            if parts[i]:
                raw = bytearray(parts[i])
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
                parts[i] = bytes(raw)
                self.counts["corrupted"] += 1
        if rng.random() < f.truncate:
            i = max(range(len(parts)), key=lambda j: len(parts[j]))
            parts[i] = parts[i][: len(parts[i]) // 2]
            self.counts["truncated"] += 1
        if rng.random() < f.duplicate:
            self.counts["duplicated"] += 1
            return [parts, parts]
        return [parts]

    def _forward(
        self, sock: Socket, parts: list[bytes], learner: int | None, direction: str
    ) -> None:
        for copy in self.injure(parts):
            if self.rng.random() < self.faults.delay:
                self.counts["delayed"] += 1
                due = time.monotonic() + self.faults.delay_seconds * (0.5 + self.rng.random())
                heapq.heappush(self.delayed, (due, next(self._tie), sock, copy, learner, direction))
            else:
                self._onto_link(sock, copy, learner, direction)

    def _onto_link(
        self, sock: Socket, parts: list[bytes], learner: int | None, direction: str
    ) -> None:
        """Through the learner's emulated link (injured first, as on a real path)."""
        nbytes = sum(len(p) for p in parts)
        if learner is None or self.links.submit(
            learner, direction, time.monotonic(), nbytes, (sock, parts)
        ):
            self._send(sock, parts)

    def read_commands(self, stream: IO[bytes]) -> None:
        """The control channel (a thread): one JSON command a line, parsed here and applied
        by :meth:`serve`; a bad line is handed on as its error message."""
        while True:
            line = stream.readline(MAX_COMMAND_BYTES + 1)
            if not line:
                return  # end of input: no more commands; forwarding goes on
            if len(line) > MAX_COMMAND_BYTES and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):  # skip the rest of it
                    line = stream.readline(MAX_COMMAND_BYTES + 1)
                self.commands.put(f"a line longer than {MAX_COMMAND_BYTES} bytes")
                continue
            if not line.strip():
                continue
            try:
                self.commands.put(parse_command(line.strip()))
            except ValueError as exc:  # JSON and UTF-8 errors are ValueErrors too
                self.commands.put(f"{exc} in {line[:200]!r}")

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, str):
                self.counts["bad_commands"] += 1
                log.warning("proxy: ignored a bad control command: %s", command)
            elif isinstance(command, Open):
                self.open.set()
                log.info("proxy: open")
            else:
                self.links.apply(command, time.monotonic())
                log.info("proxy: %s", command)

    def _send(self, sock: Socket, parts: list[bytes]) -> None:
        try:
            sock.send_multipart(parts, zmq.NOBLOCK)
        except zmq.ZMQError:
            self.counts["unroutable"] += 1

    def serve(self) -> None:
        while not self.stop.is_set() and not self.open.is_set():  # held: frames wait in zmq
            self._apply_commands()
            self.stop.wait(0.01)
        while not self.stop.is_set():
            for sock, _ in self.poller.poll(10):
                while True:
                    try:
                        raw = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    frames = [f.bytes for f in raw]
                    if sock is self.front:  # learner -> syncer, as its handshake says
                        link = link_of(raw[-1].get("User-Id"))
                        if link is None or len(frames) < 2:
                            continue
                        self.routes[link] = frames[0]
                        if (
                            link[1]
                            and peek_kind(frames[1]) == AnswerPart.KIND
                            and self.rng.random() < self.faults.drop_parts
                        ):
                            self.counts["dropped_parts"] += 1
                            continue
                        self._forward(self._back(link), frames[1:], link[0], UP)
                    else:  # syncer -> learner
                        link = self.back_link[sock]
                        route = self.routes.get(link)
                        if route is not None:
                            self._forward(self.front, [route, *frames], link[0], DOWN)
            self._apply_commands()
            self._renew_backs()
            now = time.monotonic()
            while self.delayed and self.delayed[0][0] <= now:
                _, _, sock, parts, learner, direction = heapq.heappop(self.delayed)
                self._onto_link(sock, parts, learner, direction)
            for sock, parts in self.links.due(time.monotonic()):
                self._send(sock, parts)
        for watch in self.watches.values():
            watch.close()
        for sock in (self.front, *self.backs.values()):
            sock.close(0)
        self.gate.close()


def commands() -> IO[bytes]:
    """stdin, for the control thread: an unbuffered reader of its own where stdin is a file
    (a daemon thread blocked in ``sys.stdin``'s buffered readline holds its lock, and the
    interpreter's exit then aborts: "could not acquire lock for <stdin> at interpreter
    shutdown"); the host's own where it is not one (a Ray actor's inbox, ray/actor.py)."""
    try:
        fd = sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):  # (io.UnsupportedOperation is both)
        return sys.stdin.buffer
    return os.fdopen(os.dup(fd), "rb", buffering=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT learners connect to")
    parser.add_argument("--target", required=True, help="HOST:PORT of the syncer")
    parser.add_argument("--faults", default="", help="e.g. drop=0.02,corrupt=0.01,delay=0.05")
    parser.add_argument("--run-id", required=True, help="the run's id (credentials bind it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--gbps",
        type=float,
        default=DEFAULT_GBPS,
        help="a learner link's nominal Gbit/s (link_slow divides it)",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help='read link commands on stdin, one JSON object a line; forward from {"open": true}',
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s"
    )
    proxy = FaultProxy(
        args.listen,
        args.target,
        Faults.parse(args.faults),
        args.seed,
        args.gbps,
        run=args.run_id,
        secret=load_secret(None),
        held=args.control,
    )
    terminate.on_terminate(proxy.stop.set)  # (SIGTERM; on Ray, its actor's stop call)
    if args.control:
        threading.Thread(target=proxy.read_commands, args=(commands(),), daemon=True).start()
    print(EVENT_PREFIX + json.dumps({"kind": "proxy_up", "t": 0.0}), flush=True)
    proxy.serve()
    record = {"kind": "proxy", "t": 0.0, "counts": dict(sorted(proxy.counts.items()))}
    print(EVENT_PREFIX + json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
