"""A fault-injecting proxy between learners and the syncer: chaos for the wire.

Owns nothing of the algorithm: it forwards zmq multipart frames between learners (which
connect to it as if it were the syncer) and the syncer (to which it connects once per
learner, under that learner's identity), and on the way drops, delays (so reorders),
duplicates, truncates and corrupts them at the rates of a :class:`Faults` spec such as
``"drop=0.02,duplicate=0.02,corrupt=0.01,truncate=0.01,delay=0.05"``. Seeded, so a spec and a
seed replay the same decisions for the same traffic. Run by the launcher when
``processes.proxy`` is set, or by hand::

    python -m ddiloco.runtime.processes.proxy --listen 127.0.0.1:6000 \
        --target 127.0.0.1:5555 --faults drop=0.01,corrupt=0.01
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import random
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

import zmq

from ddiloco.errors import ConfigError, require
from ddiloco.runtime.processes.common import EVENT_PREFIX, Socket

KINDS = ("drop", "duplicate", "corrupt", "truncate", "delay")


@dataclass(frozen=True)
class Faults:
    """Per-message probabilities of each fault, and how long a delay lasts."""

    drop: float = 0.0
    duplicate: float = 0.0
    corrupt: float = 0.0
    truncate: float = 0.0
    delay: float = 0.0
    delay_seconds: float = 0.05

    def __post_init__(self) -> None:
        for kind in KINDS:
            p = getattr(self, kind)
            require(0.0 <= p <= 1.0, f"processes.proxy.{kind}", p, "a probability in [0, 1]")
        require(self.delay_seconds >= 0, "processes.proxy.delay_seconds", self.delay_seconds,
                "must be >= 0")  # fmt: skip

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


class FaultProxy:
    """Forwards learner <-> syncer traffic, injuring it on the way."""

    def __init__(self, listen: str, target: str, faults: Faults, seed: int = 0) -> None:
        self.faults = faults
        self.target = target
        self.rng = random.Random(seed)
        self.ctx: zmq.Context[Socket] = zmq.Context.instance()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.front.bind(f"tcp://{listen}")
        self.backs: dict[bytes, Socket] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.front, zmq.POLLIN)
        self.delayed: list[tuple[float, int, Socket, list[bytes]]] = []
        self._tie = itertools.count()
        self.counts: Counter[str] = Counter()
        self.stop = threading.Event()

    def _back(self, ident: bytes) -> Socket:
        sock = self.backs.get(ident)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, ident)
            sock.connect(f"tcp://{self.target}")
            self.backs[ident] = sock
            self.poller.register(sock, zmq.POLLIN)
        return sock

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

    def _forward(self, sock: Socket, parts: list[bytes]) -> None:
        for copy in self.injure(parts):
            if self.rng.random() < self.faults.delay:
                self.counts["delayed"] += 1
                due = time.monotonic() + self.faults.delay_seconds * (0.5 + self.rng.random())
                heapq.heappush(self.delayed, (due, next(self._tie), sock, copy))
            else:
                self._send(sock, copy)

    def _send(self, sock: Socket, parts: list[bytes]) -> None:
        try:
            sock.send_multipart(parts, zmq.NOBLOCK)
        except zmq.ZMQError:
            self.counts["unroutable"] += 1

    def serve(self) -> None:
        while not self.stop.is_set():
            for sock, _ in self.poller.poll(10):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if sock is self.front:  # learner -> syncer
                        self._forward(self._back(frames[0]), frames[1:])
                    else:  # syncer -> learner
                        ident = sock.getsockopt(zmq.IDENTITY)
                        self._forward(self.front, [ident, *frames])
            now = time.monotonic()
            while self.delayed and self.delayed[0][0] <= now:
                _, _, sock, parts = heapq.heappop(self.delayed)
                self._send(sock, parts)
        for sock in (self.front, *self.backs.values()):
            sock.close(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT learners connect to")
    parser.add_argument("--target", required=True, help="HOST:PORT of the syncer")
    parser.add_argument("--faults", default="", help="e.g. drop=0.02,corrupt=0.01,delay=0.05")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    proxy = FaultProxy(args.listen, args.target, Faults.parse(args.faults), args.seed)
    signal.signal(signal.SIGTERM, lambda *_: proxy.stop.set())
    print(EVENT_PREFIX + json.dumps({"kind": "proxy_up", "t": 0.0}), flush=True)
    proxy.serve()
    record = {"kind": "proxy", "t": 0.0, "counts": dict(sorted(proxy.counts.items()))}
    print(EVENT_PREFIX + json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
