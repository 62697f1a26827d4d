"""A learner's link on real sockets, its syncer restarted or refusing its answers: it renews
its one-time ticket on a new socket (zmq would present the spent one again), and answers
refused as invalid again and again make it register again, then stop, saying why."""

from __future__ import annotations

import logging
import time

from test_liveness import linked  # noqa: F401  (the fixture: a syncer socket, a LIVE link)

from ddiloco.core.codec import CodecSpec
from ddiloco.runtime.processes import protocol
from ddiloco.runtime.processes.launcher.fragments import free_port
from ddiloco.runtime.processes.learner.link import (
    INVALID_RESYNC,
    INVALID_RESYNCS,
    LinkState,
    SyncerLink,
)
from ddiloco.runtime.processes.syncer.connections import Connections, Incoming
from ddiloco.runtime.processes.transport.sockets import new_session
from ddiloco.runtime.processes.transport.tickets import TicketBook
from ddiloco.runtime.processes.transport.wire import Limits, Wire

RUN, SECRET = "liveness", b"k" * 32


def hellos(conn: Connections, seconds: float, enough: int | None = None) -> int:
    """Hellos the syncer socket received in ``seconds`` (or until ``enough``), each welcomed."""
    count, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline and (enough is None or count < enough):
        if not conn.poll(0.05):
            continue
        while (msg := conn.receive()) is not False:
            if isinstance(msg, Incoming) and msg.kind == "hello":
                count += 1
                conn.send(0, "welcome", meta={"global_step": 0, "versions": [0]})
                conn.beats = {0: True}
    return count


def test_a_restarted_syncer_is_reached_with_a_fresh_ticket(tmp_path):
    """Both syncer lives journal their tickets, as the syncer does in its store: the ticket
    zmq would reconnect with is refused by the second life, so the link must renew it."""
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    journal = tmp_path / "tickets.bin"
    conn = Connections(address, RUN, SECRET, 1, Limits(), shm=False, tickets=TicketBook(journal))
    link = SyncerLink(
        address,
        Wire(RUN, SECRET, "L0", new_session(), Limits()),
        0,
        CodecSpec(),
        [[(4,)]],
        silence_seconds=60.0,  # (not noticed by silence: by the closed connection)
        beat_seconds=0.25,
    )
    link.start()
    link.register(protocol.Hello(link.wire.session, 0, [0]))
    restarted = None
    try:
        assert hellos(conn, 10.0, enough=1) == 1 and conn.gate.counts["accepted"] == 1
        conn.close()  # the syncer dies; a new life binds the same address, with the journal
        restarted = Connections(
            address, RUN, SECRET, 1, Limits(), shm=False, tickets=TicketBook(journal)
        )
        assert hellos(restarted, 10.0, enough=1) == 1  # the link came back on its own
        time.sleep(0.3)
        assert link.state is LinkState.LIVE and link.fatal is None and link.reconnects == 1
        assert restarted.gate.counts["accepted"] == 1  # a fresh ticket, the spent one unused
        assert restarted.gate.counts["refused_replayed"] == 0
    finally:
        link.close(0.1)
        if restarted is not None:
            restarted.close()


def test_answers_refused_as_invalid_again_and_again_resync_then_stop(linked, caplog):  # noqa: F811
    conn, link = linked
    caplog.set_level(logging.WARNING)
    hellos(conn, 0.2)
    for round_ in range(INVALID_RESYNCS):
        for i in range(INVALID_RESYNC):
            conn.send(0, "verdict", fragment=0, meta={"key": [0, 1, i], "verdict": "invalid"})
        assert hellos(conn, 2.0) >= 1, round_  # it registered again
        assert link.fatal is None
    assert "answers in a row refused as invalid" in caplog.text
    conn.send(0, "verdict", fragment=0, meta={"key": [0, 1, 0], "verdict": "stale"})
    for i in range(INVALID_RESYNC * INVALID_RESYNCS):  # a verdict not invalid started over
        conn.send(0, "verdict", fragment=0, meta={"key": [0, 1, i], "verdict": "invalid"})
    hellos(conn, 1.0)
    assert link.fatal is None
    for i in range(INVALID_RESYNC):
        conn.send(0, "verdict", fragment=0, meta={"key": [0, 1, i], "verdict": "invalid"})
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and link.fatal is None:
        hellos(conn, 0.1)
    assert link.fatal is not None and "refused as invalid" in link.fatal
    assert link.state is LinkState.FAILED
