"""The fault-injecting proxy's spec and decisions: validated, seeded, and each fault real."""

from __future__ import annotations

import contextlib
import io
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from ddiloco.errors import ConfigError
from ddiloco.runtime.processes.transport.auth import Gatekeeper, present, serve_plain
from ddiloco.runtime.processes.transport.proxy import (
    DOWN,
    OPEN,
    UP,
    FaultProxy,
    Faults,
    LinkCommand,
    LinkShaper,
    parse_command,
)
from ddiloco.runtime.processes.transport.wire import Wire, WireError

SECRET = b"k" * 32
AUTH = {"run": "r", "secret": SECRET}


def test_a_spec_is_parsed_and_a_bad_one_names_the_field():
    f = Faults.parse("drop=0.1, delay=0.5,delay_seconds=0.2")
    assert (f.drop, f.delay, f.delay_seconds, f.corrupt) == (0.1, 0.5, 0.2, 0.0)
    with pytest.raises(ConfigError, match=r"processes\.proxy"):
        Faults.parse("lose=0.1")
    with pytest.raises(ConfigError, match=r"processes\.proxy\.drop"):
        Faults.parse("drop=1.5")
    with pytest.raises(ConfigError, match=r"processes\.proxy\.corrupt"):
        Faults.parse("corrupt=lots")


@pytest.mark.parametrize(
    ("spec", "reason", "copies"),
    [
        ("drop=1", None, 0),
        ("duplicate=1", "replay", 2),
        ("corrupt=1", "checksum", 1),
        ("truncate=1", "truncated", 1),
    ],
)
def test_each_fault_damages_a_frame_the_way_the_wire_then_refuses(spec, reason, copies):
    proxy = FaultProxy("127.0.0.1:0", "127.0.0.1:1", Faults.parse(spec), seed=3, **AUTH)
    try:
        tx, rx = Wire("r", b"k" * 32, "L0", 1), Wire("r", b"k" * 32, "S", 1)
        frame = [bytes(p) for p in tx.encode("answer", payload=b"\x07" * 300)]
        out = proxy.injure(frame)
        assert len(out) == copies
        if reason == "replay":
            rx.decode(out[0])
        if reason is not None:
            with pytest.raises(WireError) as info:
                rx.decode(out[-1])
            # a flipped bit may land in the prefix: then the sizes or the magic refuse it first
            assert info.value.reason in (reason, "truncated", "oversized", "magic", "version")
    finally:
        proxy.front.close(0)


def test_the_same_seed_makes_the_same_decisions():
    def decisions(seed: int) -> list[int]:
        proxy = FaultProxy(
            "127.0.0.1:0", "127.0.0.1:1", Faults.parse("drop=0.5"), seed=seed, **AUTH
        )
        try:
            return [len(proxy.injure([b"a", b"b", b"c"])) for _ in range(50)]
        finally:
            proxy.front.close(0)

    assert decisions(1) == decisions(1) != decisions(2)


# -- link faults: the control channel, the link emulation, and the proxy on loopback -------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b'{"link": 2, "cut_seconds": 5.0}', LinkCommand(2, cut_seconds=5.0)),
        ('{"link": 0, "cut_seconds": 0}', LinkCommand(0, cut_seconds=0.0)),
        (b'{"link": 1, "factor": 4, "seconds": 0}', LinkCommand(1, factor=4.0, seconds=0.0)),
        (b'{"factor": 0.5, "link": 3}', LinkCommand(3, factor=0.5, seconds=0.0)),
        (b'{"open": true}', OPEN),
    ],
)
def test_a_good_link_command_is_parsed(line, expected):
    assert parse_command(line) == expected


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b"not json", "Expecting value"),
        (b"[1, 2]", "JSON object"),
        (b'{"cut_seconds": 1}', "'link'"),
        (b'{"link": true, "cut_seconds": 1}', "'link'"),
        (b'{"link": -1, "cut_seconds": 1}', "'link'"),
        (b'{"link": "1", "cut_seconds": 1}', "'link'"),
        (b'{"link": 1, "cut_seconds": -1}', "'cut_seconds'"),
        (b'{"link": 1, "cut_seconds": NaN}', "NaN"),
        (b'{"link": 1, "cut_seconds": Infinity}', "Infinity"),
        (b'{"link": 1, "cut_seconds": 1e999}', "finite"),
        (b'{"link": 1, "cut_seconds": 1' + b"0" * 400 + b"}", "finite"),
        (b"[" * 510 + b"]" * 510, "nested too deep|JSON object"),
        (b'{"link": 1, "cut_seconds": "5"}', "a number"),
        (b'{"link": 1, "factor": 0}', "'factor'"),
        (b'{"link": 1, "factor": false}', "'factor'"),
        (b'{"link": 1, "factor": 2, "cut_seconds": 1}', "expected keys"),
        (b'{"link": 1, "seconds": 2}', "expected keys"),
        (b'{"open": false}', "'link'"),
        (b'{"open": true, "link": 1}', "expected keys"),
        (b'{"link": 1, "cut_seconds": 1, "exec": "rm"}', "expected keys"),
        (b"\xff\xfe", "utf-8"),
        (b'{"link": 1, "cut_seconds": 1, "pad": "' + b"x" * 2000 + b'"}', "longer than"),
    ],
)
def test_a_bad_link_command_is_refused_with_a_clear_message(line, message):
    with pytest.raises(ValueError, match=message):
        parse_command(line)


def test_the_control_channel_hands_on_good_commands_and_the_errors_of_bad_ones():
    proxy = FaultProxy("127.0.0.1:0", "127.0.0.1:1", Faults(), **AUTH)
    try:
        stream = io.BytesIO(
            b'{"link": 1, "cut_seconds": 2}\n\n{"link": 1}\n'
            + b"y" * 5000
            + b'\n{"link": 0, "factor": 3}'
        )
        proxy.read_commands(stream)
        got = []
        while not proxy.commands.empty():
            got.append(proxy.commands.get_nowait())
        assert got[0] == LinkCommand(1, cut_seconds=2.0)
        assert isinstance(got[1], str) and "expected keys" in got[1]
        assert isinstance(got[2], str) and "longer than" in got[2]
        assert got[3] == LinkCommand(0, factor=3.0)
        assert len(got) == 4
        for command in got:
            proxy.commands.put(command)
        proxy._apply_commands()  # bad ones are counted, logged and ignored
        assert proxy.counts["bad_commands"] == 2
        assert (proxy.counts["link_cut"], proxy.counts["link_slow"]) == (1, 1)
        assert proxy.links.cut_until[1] > 0 and proxy.links.factor[0] == 3.0
    finally:
        proxy.front.close(0)


def test_a_cut_holds_a_learners_frames_both_ways_and_releases_them_in_order():
    links: LinkShaper[str] = LinkShaper(gbps=1.0)
    links.cut(1, now=10.0, seconds=5.0)
    assert links.submit(0, UP, 10.5, 100, "other")  # another learner's link is untouched
    assert not links.submit(1, UP, 11.0, 100, "a")
    assert not links.submit(1, DOWN, 12.0, 100, "x")
    assert not links.submit(1, UP, 13.0, 100, "b")
    assert links.due(14.99) == []
    assert links.due(15.0) == ["a", "b", "x"]  # nothing dropped, each link in order
    assert links.pending() == 0 and links.counts["held"] == 3
    assert links.submit(1, UP, 15.1, 100, "c")  # after the cut: straight through again
    links.cut(1, now=20.0, seconds=1.0)
    links.cut(1, now=20.5, seconds=0.2)  # a shorter cut inside a longer one does not end it
    assert not links.submit(1, UP, 20.8, 100, "d")
    assert links.due(20.9) == [] and links.due(21.0) == ["d"]


def test_a_slow_link_carries_frames_one_at_a_time_at_bandwidth_over_factor():
    links: LinkShaper[str] = LinkShaper(gbps=0.001)  # 125_000 bytes/s nominal
    links.slow(1, now=0.0, factor=4.0, seconds=10.0)  # 31_250 bytes/s
    assert links.submit(0, UP, 0.0, 125_000, "fast")  # learner 0 is not slowed
    assert not links.submit(1, UP, 1.0, 31_250, "a")  # 1 s on the wire
    assert not links.submit(1, UP, 1.0, 31_250, "b")  # queued behind it: done at 3 s
    assert not links.submit(1, DOWN, 1.0, 15_625, "x")  # the other direction: its own link
    assert links.due(1.4) == []
    assert links.due(1.5) == ["x"]
    assert links.due(1.99) == [] and links.due(2.0) == ["a"]
    assert links.due(2.99) == [] and links.due(3.0) == ["b"]
    assert links.counts["slowed"] == 3
    assert links.submit(1, UP, 10.0, 31_250, "after")  # restored after `seconds`
    links.slow(1, now=20.0, factor=2.0, seconds=0.0)  # 0: to the end
    assert not links.submit(1, UP, 1e6, 62_500, "late")
    assert links.due(1e6 + 0.99) == [] and links.due(1e6 + 1.0) == ["late"]


def test_a_cut_and_a_slow_link_add_up_like_the_simulated_clocks():
    links: LinkShaper[str] = LinkShaper(gbps=0.001)
    links.slow(2, now=0.0, factor=2.0, seconds=0.0)
    links.cut(2, now=0.0, seconds=3.0)
    assert not links.submit(2, UP, 1.0, 62_500, "a")  # starts when the cut ends, takes 1 s
    assert links.due(3.99) == [] and links.due(4.0) == ["a"]


def _recv(sock: zmq.Socket, timeout: float, routes: dict | None = None) -> list[bytes] | None:
    """One message; at a server, [the sender's authenticated name, *parts]."""
    if sock.poll(int(timeout * 1000)):
        frames = sock.recv_multipart(copy=False)
        if routes is None:
            return [f.bytes for f in frames]
        user = frames[-1].get("User-Id")
        routes[user] = frames[0].bytes
        return [user.encode(), *(f.bytes for f in frames[1:])]
    return None


@contextlib.contextmanager
def _rig(held: bool = False) -> Iterator[tuple[FaultProxy, zmq.Socket, dict, dict]]:
    """A syncer socket, a serving proxy in front of it and learners 0 and 1 dialing it:
    (proxy, syncer, learners, routes)."""
    ctx = zmq.Context()
    gate = Gatekeeper(ctx, SECRET, "r", lambda name: True)
    gate.start()
    syncer = ctx.socket(zmq.ROUTER)
    syncer.setsockopt(zmq.LINGER, 0)
    serve_plain(syncer)
    port = syncer.bind_to_random_port("tcp://127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        listen = f"127.0.0.1:{s.getsockname()[1]}"
    proxy = FaultProxy(listen, f"127.0.0.1:{port}", Faults(), seed=1, held=held, **AUTH)
    thread = threading.Thread(target=proxy.serve, daemon=True)
    thread.start()
    learners = {}
    try:
        for m in (0, 1):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            present(sock, SECRET, "r", f"L{m}")
            sock.connect(f"tcp://{listen}")
            learners[m] = sock
        yield proxy, syncer, learners, {}
    finally:
        proxy.stop.set()
        thread.join(timeout=5.0)
        for sock in (syncer, *learners.values()):
            sock.close(0)
        gate.close()
        ctx.term()


def test_the_proxy_holds_a_cut_learners_traffic_on_loopback_and_lets_the_others_through():
    with _rig() as (proxy, syncer, learners, routes):
        learners[1].send_multipart([b"hello"])  # both connected before the cut
        assert _recv(syncer, 5.0, routes) == [b"L1", b"hello"]
        proxy.commands.put(LinkCommand(1, cut_seconds=1.0))
        time.sleep(0.1)  # applied within one poll (10 ms)
        cut_at = time.monotonic()
        learners[1].send_multipart([b"one"])
        learners[1].send_multipart([b"two"])
        learners[0].send_multipart([b"zero"])
        syncer.send_multipart([routes["L1"], b"down"])
        assert _recv(syncer, 0.5, routes) == [b"L0", b"zero"]  # learner 0 is not cut
        assert _recv(syncer, 0.3, routes) is None  # learner 1's frames are held
        assert _recv(syncer, 2.0, routes) == [b"L1", b"one"]  # released, in order, after the cut
        assert time.monotonic() - cut_at >= 0.9
        assert _recv(syncer, 1.0, routes) == [b"L1", b"two"]
        assert _recv(learners[1], 1.0) == [b"down"]  # the syncer -> learner way too
        assert proxy.counts["held"] == 3 and proxy.counts["link_cut"] == 1


def test_a_held_proxy_forwards_nothing_before_open_so_a_replayed_cut_is_never_slipped():
    """A restarted proxy (``--control``) hears what is left of a cut before it opens: a cut
    learner that dials it at once is still held; the others pass from the open on."""
    with _rig(held=True) as (proxy, syncer, learners, routes):
        learners[1].send_multipart([b"early"])  # dialed the restarted proxy at once
        learners[0].send_multipart([b"zero"])
        assert _recv(syncer, 0.5, routes) is None  # held: nothing forwarded yet
        proxy.commands.put(LinkCommand(1, cut_seconds=1.0))  # what is left of the cut
        proxy.commands.put(parse_command(b'{"open": true}'))
        opened = time.monotonic()
        assert _recv(syncer, 2.0, routes) == [b"L0", b"zero"]
        assert _recv(syncer, 0.5, routes) is None  # learner 1 is cut
        assert _recv(syncer, 2.0, routes) == [b"L1", b"early"]
        assert time.monotonic() - opened >= 0.9
