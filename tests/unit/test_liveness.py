"""Both ends of a learner's link stay alive whatever their main threads do: the syncer's
network thread beats and stamps what arrives while its loop is busy (a long merge), and the
learner's link thread beats while its training thread is in a long step. A real syncer
socket (:class:`Connections`) and a real learner link (:class:`SyncerLink`), in one process:
both ends' threads compete with the busy thread for one GIL, the harder case."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import torch

from ddiloco.core.codec import CodecSpec
from ddiloco.runtime.processes import protocol
from ddiloco.runtime.processes.launcher.fragments import free_port
from ddiloco.runtime.processes.learner.link import LinkState, SyncerLink
from ddiloco.runtime.processes.syncer.connections import (
    BEAT_SECONDS,
    STUCK_EXIT,
    Connections,
    Incoming,
)
from ddiloco.runtime.processes.transport.sockets import new_session
from ddiloco.runtime.processes.transport.wire import Limits, Wire

RUN, SECRET = "liveness", b"k" * 32
LEARNER_BEAT = 0.25


def busy(seconds: float) -> None:
    """Keep this thread working: torch kernels (the GIL released) half the time, pure
    Python (the GIL held, handed over at the switch interval) the other half."""
    a = torch.randn(512, 512)
    end = time.perf_counter() + seconds / 2
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)
    end = time.perf_counter() + seconds / 2
    n = 0
    while time.perf_counter() < end:
        n += 1


@pytest.fixture
def linked() -> Iterator[tuple[Connections, SyncerLink]]:
    """A syncer socket and a learner link to it, welcomed (LIVE)."""
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    conn = Connections(address, RUN, SECRET, 1, Limits(), shm=False)
    wire = Wire(RUN, SECRET, "L0", new_session(), Limits())
    link = SyncerLink(
        address,
        wire,
        0,
        CodecSpec(),
        [[(4,)]],
        silence_seconds=1.5,
        beat_seconds=LEARNER_BEAT,
    )
    link.start()
    link.register(protocol.Hello(wire.session, 0, [0]))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and link.state is not LinkState.LIVE:
        if conn.poll(0.05):
            msg = conn.receive()
            if isinstance(msg, Incoming) and msg.kind == "hello":
                conn.send(0, "welcome", meta={"global_step": 0, "versions": [0]})
                conn.beats = {0: True}
    assert link.state is LinkState.LIVE
    yield conn, link
    link.close(0.1)
    conn.close()


def beats_received(conn: Connections) -> list[float]:
    times = []
    while (msg := conn.receive()) is not False:
        if isinstance(msg, Incoming) and msg.kind == "beat":
            times.append(msg.at)
    return times


def test_both_ends_stay_alive_while_their_main_threads_are_busy(linked):
    conn, link = linked
    beats_received(conn)
    started = time.monotonic()
    busy(4.0)  # the syncer's loop does not turn, the learner's training thread does not step
    took = time.monotonic() - started
    # the learner heard the syncer's beats throughout: it never thought it silent
    assert link.reconnects == 0 and link.state is LinkState.LIVE
    assert time.monotonic() - link.last_rx < 3 * BEAT_SECONDS
    # the syncer's network thread received and stamped the learner's beats as they came,
    # however late its loop reads them
    times = beats_received(conn)
    assert len(times) >= took / LEARNER_BEAT / 2, times
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) < 4 * LEARNER_BEAT, gaps
    assert link.longest_gap < 1.0, link.longest_gap


def test_a_link_whose_syncer_stopped_beating_notices_the_silence(linked):
    conn, link = linked
    conn.beats = {}  # the syncer says nothing more to this learner
    time.sleep(1.5 + 1.0)
    assert link.reconnects >= 1  # silence noticed: it reconnected and says hello again
    assert link.state is LinkState.HELLO


def test_a_link_told_to_stop_takes_the_syncers_silence_as_the_end_not_a_failure(linked):
    conn, link = linked
    conn.send(0, "stop")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and link.state is not LinkState.STOPPED:
        time.sleep(0.02)
    assert link.state is LinkState.STOPPED and link.stopped
    conn.beats = {}  # the syncer closes once the run is over; the learner finishes its step
    time.sleep(1.5 + 1.0)
    assert link.reconnects == 0 and link.state is LinkState.STOPPED
    link.register(protocol.Hello(1, 0, [0]))  # final: no hello
    time.sleep(0.2)
    assert link.state is LinkState.STOPPED


def test_a_loop_stuck_past_its_bound_stops_the_beats_so_the_learner_notices(linked):
    """Beats prove the process, not its loop: one that has not turned for ``stuck_seconds``
    must not keep its learners training alone behind them."""
    conn, link = linked
    stuck: list[float] = []
    conn.on_stuck = stuck.append
    conn.turned = time.monotonic()
    conn.stuck_seconds = 2.0  # (the loop does not turn from here: nothing polls)
    time.sleep(2.0 + 1.5 + 1.5)
    assert len(stuck) == 1 and stuck[0] > 2.0, stuck
    assert link.reconnects >= 1  # no beat came since: silence noticed


def test_a_stuck_syncer_says_so_dumps_its_threads_and_exits_to_be_restarted():
    script = textwrap.dedent(
        f"""
        import logging, time
        from ddiloco.runtime.processes.syncer.connections import Connections
        from ddiloco.runtime.processes.transport.wire import Limits
        logging.basicConfig()
        conn = Connections("127.0.0.1:{free_port("127.0.0.1")}", "r", b"k" * 32, 1, Limits(),
                           shm=False, stuck_seconds=1.0)
        time.sleep(30)  # the loop never turns
        """
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == STUCK_EXIT, (done.returncode, done.stderr[-2000:])
    assert time.monotonic() - started < 20
    assert "has not turned for" in done.stderr and "processes.stuck_seconds" in done.stderr
    assert 'File "<string>", line 8' in done.stderr  # where it was stuck: time.sleep(30)
