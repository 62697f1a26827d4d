"""Peer copies of any size over any link: a snapshot streams in chunks with a stall deadline,
not a deadline for the whole; it survives pauses and resets, fails over when its donor dies,
and refuses a hostile donor. Real sockets and processes; the link is a real TCP relay."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from typing import Any

import msgpack
import pytest
import torch

from ddiloco.runtime.processes.learner import peer
from ddiloco.runtime.processes.learner.peer import PeerError, SnapshotServer
from ddiloco.runtime.processes.learner.peer_copy import (
    by_round_trip,
    copy_from_peers,
    fetch_snapshot,
)
from ddiloco.runtime.processes.transport.tree import PREFIX, Layout, pack_tree, unpack_tree

SECRET = b"p" * 32
RUN = "run-peer"
LIMIT = 256 << 20
LOGGER = "ddiloco.runtime.processes.learner.peer_copy"


def state(megabytes: float, seed: int) -> dict[str, Any]:
    """A learner-like state: tensors of several dtypes, ints, a tuple, nested lists."""
    g = torch.Generator().manual_seed(seed)
    n = int(megabytes * (1 << 20) / 4 / 3)
    return {
        "trainer": {
            "model": {"w": torch.randn(n, generator=g), "b": torch.randn(7, 3, generator=g)},
            "optimizer": {"state": {0: {"exp_avg": torch.randn(n, generator=g)}}, "lr": 1e-3},
            "steps": 12 + seed,
        },
        "sync": {"bases": [[torch.randn(n, generator=g)], []], "versions": (3, 4)},
        "mask": torch.tensor([True, False]),
        "half": torch.ones(5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 2),
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


class Donor:
    """A snapshot server and a stand-in for the training loop: it looks at ``wanted``
    every 20 ms and provides a fresh clone of its state when asked."""

    def __init__(self, tree: Any, learner: int = 0, server: type = SnapshotServer) -> None:
        self.tree = tree
        self.server = server("127.0.0.1", RUN, SECRET, learner)
        self.server.start()
        self.provided = 0
        self.stop = threading.Event()
        self.loop = threading.Thread(target=self._loop, daemon=True)
        self.loop.start()

    def _loop(self) -> None:
        while not self.stop.wait(0.02):
            if self.server.wanted:
                clone = unpack_tree(pack_tree(self.tree))  # the learner's clone between steps
                self.server.provide(clone)
                self.provided += 1

    def close(self) -> None:
        self.stop.set()
        self.server.close()


class Relay(threading.Thread):
    """A TCP relay in front of a donor: ``rate`` bytes/s each way per connection, ``delay``
    seconds before each forward; :meth:`pause` holds every byte, :meth:`reset` drops every
    connection once, :meth:`cut` drops them and refuses new ones for good."""

    def __init__(self, target: str, rate: float = 0.0, delay: float = 0.0) -> None:
        super().__init__(daemon=True)
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.rate, self.delay = rate, delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.paused_until = 0.0
        self.conns: list[socket.socket] = []
        self.closed = False
        self.start()

    def run(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                continue
            self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self.pump, args=(a, b), daemon=True).start()

    def pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(16 << 10):
                while time.monotonic() < self.paused_until:
                    time.sleep(0.01)
                time.sleep(self.delay + (len(data) / self.rate if self.rate else 0.0))
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            s.close()

    def pause(self, seconds: float) -> None:
        self.paused_until = time.monotonic() + seconds

    def reset(self) -> None:
        for s in self.conns:
            s.close()  # pumps see the close and end; new connections are accepted
        self.conns = []

    def cut(self) -> None:
        self.closed = True
        self.listener.close()
        self.reset()


def after(seconds: float, action) -> threading.Timer:
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


def test_the_stream_format_is_pack_trees_and_is_read_in_any_ranges():
    tree = state(0.1, 1)
    layout = Layout(tree)
    blob = pack_tree(tree)
    assert layout.size == len(blob)
    pieces = [bytes(layout.read(o, 1000)) for o in range(0, layout.size, 1000)]
    assert b"".join(pieces) == blob
    assert same(unpack_tree(blob), tree)


def test_a_20_mb_snapshot_through_a_2_mb_s_link_arrives_whole_and_logs_progress(caplog):
    donor = Donor(state(20, 0))
    relay = Relay(donor.server.address, rate=2e6)
    caplog.set_level(logging.INFO, logger=LOGGER)
    try:
        copy = fetch_snapshot(relay.address, RUN, SECRET, 5, max_bytes=LIMIT)
        assert same(copy.tree, donor.tree)  # bit-exact
        assert copy.seconds > 10  # longer than the old deadline for a whole snapshot
        progress = [r.message for r in caplog.records if "copying peer" in r.message]
        assert progress and "MB/s" in progress[0] and "ETA" in progress[0]
        assert any("copied 21.0 MB" in r.message for r in caplog.records)
        deadline = time.monotonic() + 2.0  # the requester said done: freed, not kept 60 s
        while donor.server.held_bytes and time.monotonic() < deadline:
            time.sleep(0.02)
        assert donor.server.held_bytes == 0
    finally:
        relay.cut()
        donor.close()


def test_a_pause_and_a_reset_mid_copy_are_resumed_from_the_same_donor():
    donor = Donor(state(8, 0))
    relay = Relay(donor.server.address, rate=2e6)
    try:
        after(1.0, lambda: relay.pause(2.5))  # longer than a third of the stall deadline
        after(4.5, relay.reset)
        copy = fetch_snapshot(relay.address, RUN, SECRET, 5, max_bytes=LIMIT, stall_seconds=6.0)
        assert same(copy.tree, donor.tree)
        assert copy.resumes >= 2 and donor.provided == 1  # the same snapshot throughout
    finally:
        relay.cut()
        donor.close()


def test_two_newcomers_at_once_share_one_snapshot_freed_when_both_are_done():
    donor = Donor(state(4, 0))
    got: list[Any] = []

    def copy(learner: int) -> None:
        got.append(fetch_snapshot(donor.server.address, RUN, SECRET, learner, max_bytes=LIMIT))

    threads = [threading.Thread(target=copy, args=(m,)) for m in (5, 6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(got) == 2 and all(same(c.tree, donor.tree) for c in got)
        assert donor.provided == 1  # one clone on the donor, not one per newcomer
        deadline = time.monotonic() + 2.0
        while donor.server.held_bytes and time.monotonic() < deadline:
            time.sleep(0.02)
        assert donor.server.held_bytes == 0
    finally:
        donor.close()


def test_a_snapshot_left_held_by_a_dead_copy_is_not_served_to_a_later_newcomer(monkeypatch):
    monkeypatch.setattr(peer, "SHARE_SECONDS", 0.5)
    donor = Donor(state(4, 0))
    try:  # the first newcomer gives up after the announcement: the snapshot stays held
        with pytest.raises(PeerError, match="refuse"):
            fetch_snapshot(donor.server.address, RUN, SECRET, 5, max_bytes=1000)
        assert donor.server.held_bytes > 0
        donor.tree["trainer"]["steps"] = 99  # the donor trained on since
        time.sleep(0.6)
        copy = fetch_snapshot(donor.server.address, RUN, SECRET, 6, max_bytes=LIMIT)
        assert copy.tree["trainer"]["steps"] == 99 and donor.provided == 2  # a fresh one
    finally:
        donor.close()


def test_a_donor_behind_a_forwarded_port_advertises_that_port():
    relay_port = socket.create_server(("127.0.0.1", 0))  # reserve a port for the relay's role
    port = relay_port.getsockname()[1]
    relay_port.close()
    server = SnapshotServer("127.0.0.1", RUN, SECRET, 3, advertise_port=port)
    try:
        assert server.address == f"127.0.0.1:{port}" and server.port != port
    finally:
        server.ctx.destroy(0)


def _donor_process(seed: int, ports: Any) -> None:
    torch.set_num_threads(1)
    donor = Donor(state(12, seed))
    ports.put(donor.server.address)
    while True:
        time.sleep(1)


def test_a_donor_killed_mid_copy_fails_over_to_the_next_within_the_stall_deadline(caplog):
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    doomed = ctx.Process(target=_donor_process, args=(1, ports), daemon=True)
    doomed.start()
    second = Donor(state(12, 2), learner=1)
    relay = Relay(ports.get(timeout=60), rate=4e6)
    caplog.set_level(logging.INFO, logger=LOGGER)
    try:
        peers = {"0": relay.address, "1": second.server.address}  # the syncer's order
        after(1.5, lambda: os.kill(doomed.pid, 9))  # type: ignore[arg-type]
        started = time.monotonic()
        got = copy_from_peers(peers, RUN, SECRET, 5, probe=False, max_bytes=LIMIT, stall_seconds=3)
        assert got is not None and got[0] == "1"
        assert same(got[1].tree, second.tree)  # the second donor's state, not a mix
        assert time.monotonic() - started < 1.5 + 3 + 3  # killed, stalled, copied
        assert any("peer 0 failed" in r.message and "stalled" in r.message for r in caplog.records)
    finally:
        doomed.kill()
        relay.cut()
        second.close()


class LyingDigest(SnapshotServer):
    @staticmethod
    def _digest(held: Any) -> None:
        held.digest = "00" * 32


class ShortChunks(SnapshotServer):
    def _reply(self, ident: bytes, kind: str, meta: dict[str, Any], payload: Any = b"") -> None:
        super()._reply(ident, kind, meta, payload[:-1] if kind == "snap_data" else payload)


class AbsurdSize(SnapshotServer):
    def _announce(self, ident: bytes, req: int, sid: int, held: Any) -> None:
        held.readers.add(req)
        self._reply(ident, "snap_meta", {"id": sid, "size": 1 << 50, "head": 100})


class AbsurdHead(SnapshotServer):
    def provide(self, state: Any) -> None:  # a head whose one tensor claims a petabyte
        super().provide(state)
        layout = next(iter(self._held.values())).layout
        spec = {"tree": {"w": {"__tensor__": 0}}, "tensors": [["float32", [1 << 48]]]}
        head = msgpack.packb({**spec, "sizes": [1 << 50]}, use_bin_type=True)
        layout.parts[0] = memoryview(len(head).to_bytes(PREFIX, "little") + head)
        layout.head_end = PREFIX + len(head)
        layout.starts = [0]
        for part in layout.parts[:-1]:
            layout.starts.append(layout.starts[-1] + part.nbytes)
        layout.size = layout.starts[-1] + layout.parts[-1].nbytes


@pytest.mark.parametrize(
    ("server", "said"),
    [
        (LyingDigest, "does not match its BLAKE3 digest"),
        (ShortChunks, "bytes at offset 0, asked"),
        (AbsurdSize, "limit"),
        (AbsurdHead, "claims 1125899906842624 bytes"),
    ],
)
def test_a_hostile_donor_is_refused_naming_it_and_nothing_is_allocated(server, said):
    donor = Donor(state(1, 0), server=server)
    try:
        with pytest.raises(PeerError) as info:
            fetch_snapshot(donor.server.address, RUN, SECRET, 5, max_bytes=LIMIT, stall_seconds=3)
        assert donor.server.address in str(info.value) and said in str(info.value)
    finally:
        donor.close()


def test_the_nearest_donor_is_tried_first_and_equals_keep_the_syncers_order():
    far, near, other = Donor(state(0.01, 0)), Donor(state(0.01, 1), 1), Donor(state(0.01, 2), 2)
    relay = Relay(far.server.address, delay=0.05)  # a far site: 50 ms each way per hop
    try:
        peers = {"0": relay.address, "2": other.server.address, "1": near.server.address}
        order = [pid for pid, _ in by_round_trip(peers, RUN, SECRET, 5)]
        assert order == ["2", "1", "0"]
    finally:
        relay.cut()
        for d in (far, near, other):
            d.close()


def test_a_donor_claiming_fragment_versions_the_syncer_never_made_is_refused_for_the_next(
    caplog,
):
    from ddiloco.runtime.processes.learner.engine import snapshot_refusal

    liar, honest = state(1, 1), state(1, 2)
    liar["sync"]["versions"] = (3, 1004)  # +1000: every answer it made would be invalid
    donors = [Donor(liar, learner=0), Donor(honest, learner=1)]
    caplog.set_level(logging.WARNING, logger=LOGGER)
    try:
        peers = {"0": donors[0].server.address, "1": donors[1].server.address}
        got = copy_from_peers(
            peers,
            RUN,
            SECRET,
            5,
            probe=False,
            max_bytes=LIMIT,
            refuse=lambda c: snapshot_refusal(c.tree, [3, 4], 2),
        )
        assert got is not None and got[0] == "1" and same(got[1].tree, honest)
        (said,) = [r.message for r in caplog.records if "refused" in r.message]
        assert "peer 0" in said and "fragment 1 at version 1004" in said and "syncer's 4" in said
    finally:
        for donor in donors:
            donor.close()


def test_a_snapshot_is_checked_against_the_plan_and_the_syncers_versions():
    from ddiloco.runtime.processes.learner.engine import snapshot_refusal

    assert snapshot_refusal({"sync": {"versions": [3, 4]}}, [3, 4], 2) is None
    assert snapshot_refusal({"sync": {"versions": [2, 0]}}, [3, 4], 2) is None  # behind: fine
    assert snapshot_refusal({"sync": {"versions": [3, 4]}}, None, 2) is None  # not said
    assert "later than" in str(snapshot_refusal({"sync": {"versions": [4, 4]}}, [3, 4], 2))
    assert "3 fragment versions" in str(snapshot_refusal({"sync": {"versions": [1] * 3}}, None, 2))
    for hostile in ({}, {"sync": {}}, {"sync": {"versions": "x"}}, [], {"sync": {"versions": 7}}):
        assert "no fragment versions" in str(snapshot_refusal(hostile, [3, 4], 2))


def test_a_flood_of_snapshot_requests_is_bounded_and_said(caplog):
    """An insider asks for snapshots as fast as it can, from one connection and from many:
    one connection is served once a second, at most 16 newcomers wait at once, the rest are
    told ``snap_busy`` (a newcomer told so tries its next donor); each refusal is counted
    and said. The donor's loop is frozen meanwhile: nothing is taken, so they all wait."""
    import zmq

    from ddiloco.runtime.processes.transport.auth import present
    from ddiloco.runtime.processes.transport.sockets import new_session
    from ddiloco.runtime.processes.transport.wire import Limits, Wire

    caplog.set_level(logging.WARNING)
    server = SnapshotServer("127.0.0.1", RUN, SECRET, 0)
    server.start()
    ctx = zmq.Context()
    socks = []
    try:
        for m in range(24):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            present(sock, SECRET, RUN, f"L{m}")
            sock.connect(f"tcp://{server.address}")
            socks.append(sock)
        wire = Wire(RUN, SECRET, "R9", new_session(), Limits(max_payload=1024))
        for i in range(500):  # one connection, 500 requests
            socks[0].send_multipart(wire.encode("snap_begin", learner=0, meta={"req": i}))
        for m, sock in enumerate(socks[1:], start=1):  # 23 more newcomers, one request each
            sock.send_multipart(wire.encode("snap_begin", learner=m, meta={"req": 1000 + m}))
        busy = 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and busy < 24 - peer.MAX_WAITING:
            for sock in socks[1:]:
                while sock.poll(0):
                    busy += wire.decode(sock.recv_multipart()).kind == "snap_busy"
            time.sleep(0.02)
        assert busy == 24 - peer.MAX_WAITING
        assert len(server._waiting) == peer.MAX_WAITING
        assert server.refused["begin_rate"] == 499 and server.refused["busy"] == busy
        assert "refused 1 snapshot requests (too many newcomers at once)" in caplog.text
        assert "(asked too often)" in caplog.text
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
        server.close()
