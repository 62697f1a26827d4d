"""A learner's link (learner/link.py) against a real syncer socket, the test playing the
service: answers stay pending until acknowledged and are pushed again to a restarted syncer,
a rehello makes it register again, a merged fragment lands in its inbox and acknowledges the
answers it merged, a malformed message from the syncer is dropped, not obeyed, the syncer's
orders outlive a reconnect, and answers sent through /dev/shm go again inline when the
syncer cannot read them."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from test_liveness import linked  # noqa: F401  (the fixture: a syncer socket, a LIVE link)

from ddiloco.core.codec import CodecSpec, encode_tensors
from ddiloco.core.learner_state import Answer
from ddiloco.core.rounds import AnswerMeta
from ddiloco.runtime.processes import protocol
from ddiloco.runtime.processes.launcher.fragments import free_port
from ddiloco.runtime.processes.learner.link import LinkState, SyncerLink
from ddiloco.runtime.processes.learner.pending import PendingAnswers
from ddiloco.runtime.processes.syncer.connections import Connections, Incoming
from ddiloco.runtime.processes.transport.sockets import new_session
from ddiloco.runtime.processes.transport.wire import Limits, Wire

RUN, SECRET = "liveness", b"k" * 32


def answer(seq: int, base: int = 0) -> Answer:
    meta = AnswerMeta(0, 1, seq, 0, 3, base, seq + 1, 1, 64)
    return Answer(meta, [torch.full((4,), float(seq))])


def serve(conn: Connections, seconds: float, until: Callable[[list[Incoming]], bool]) -> list:
    """Play the service for at most ``seconds``: welcome every hello; the messages taken."""
    got: list[Incoming] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not until(got):
        if not conn.poll(0.05):
            continue
        while (msg := conn.receive()) is not False:
            if not isinstance(msg, Incoming):
                continue
            got.append(msg)
            if msg.kind == "hello":
                conn.send(0, "welcome", meta=protocol.Welcome(0, [0]).meta())
                conn.beats = {0: True}
    return got


def kinds(got: list[Incoming], kind: str) -> list[Incoming]:
    return [m for m in got if m.kind == kind]


def send(conn: Connections, message: protocol.Message, **kw) -> None:
    conn.send(0, message.KIND, meta=message.meta(), **kw)


def test_answers_stay_pending_until_acknowledged_and_go_again_to_a_restarted_syncer():
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    conn = Connections(address, RUN, SECRET, 1, Limits(), shm=False)
    wire = Wire(RUN, SECRET, "L0", new_session(), Limits())
    link = SyncerLink(address, wire, 0, CodecSpec(), [[(4,)]], silence_seconds=1.0,
                      beat_seconds=0.2)  # fmt: skip
    link.start()
    link.register(protocol.Hello(wire.session, 0, [0]))
    restarted = None
    try:
        serve(conn, 10.0, lambda got: link.state is LinkState.LIVE)
        for seq in (0, 1):
            link.push(answer(seq))
        got = serve(conn, 5.0, lambda got: len(kinds(got, "answer")) == 2)
        assert [m.meta["seq"] for m in kinds(got, "answer")] == [0, 1]
        assert sorted(link.pending) == [(0, 1, 0), (0, 1, 1)]
        send(conn, protocol.Verdict((0, 1, 0), "stale"), fragment=0)  # answer 0 is judged
        serve(conn, 2.0, lambda got: len(link.pending) == 1)
        assert list(link.pending) == [(0, 1, 1)]
        conn.close()  # the syncer dies; another life binds the same address
        restarted = Connections(address, RUN, SECRET, 1, Limits(), shm=False)
        got = serve(restarted, 15.0, lambda got: bool(kinds(got, "answer")))
        assert kinds(got, "hello") and [m.meta["seq"] for m in kinds(got, "answer")] == [1]
        assert link.reconnects >= 1 and link.fatal is None
    finally:
        link.close(0.1)
        (restarted or conn).close()


def test_a_rehello_makes_the_link_register_again(linked):  # noqa: F811
    conn, link = linked
    serve(conn, 0.3, lambda got: False)
    send(conn, protocol.Rehello())
    got = serve(conn, 5.0, lambda got: bool(kinds(got, "hello")))
    assert kinds(got, "hello")[0].meta["inc"] == link.wire.session
    serve(conn, 2.0, lambda got: link.state is LinkState.LIVE)
    assert link.state is LinkState.LIVE  # welcomed again


def test_a_merged_fragment_lands_in_the_inbox_and_acknowledges_what_it_merged(linked):  # noqa: F811
    conn, link = linked
    for seq in (0, 1, 2):
        link.push(answer(seq, base=0 if seq < 2 else 1))
    serve(conn, 5.0, lambda got: len(kinds(got, "answer")) == 3)
    payload = encode_tensors([torch.full((4,), 9.0)], CodecSpec())
    # it merged answer 1: answer 0 (same life, fragment and base) needs no re-push either
    send(conn, protocol.Fragment(1, [(0, 1, 1)]), fragment=0, payload=payload)
    serve(conn, 2.0, lambda got: len(link.pending) == 1)
    assert list(link.pending) == [(0, 1, 2)]  # on a later base: still owed
    version, values = link.take_inbox()[0]
    assert version == 1 and torch.equal(values[0], torch.full((4,), 9.0))


def test_a_malformed_message_from_the_syncer_is_dropped_not_obeyed(linked):  # noqa: F811
    conn, link = linked
    conn.send(0, "refused", meta={"why": ["not", "text"]})  # would stop the learner
    conn.send(0, "welcome", meta={"global_step": -5, "versions": [0]})
    serve(conn, 1.0, lambda got: link.wire.refused["meta"] >= 2)
    assert link.wire.refused["meta"] == 2
    assert link.fatal is None and link.state is LinkState.LIVE
    assert link.welcome == protocol.Welcome(0, [0])  # the first, well-formed one
    conn.send(0, "refused", meta={"why": "a newer process took this slot"})
    serve(conn, 2.0, lambda got: link.fatal is not None)
    assert link.state is LinkState.FAILED and "a newer process" in (link.fatal or "")


def test_the_link_builds_every_syncer_kinds_handler():
    link = SyncerLink("127.0.0.1:1", Wire(RUN, SECRET, "L0", 1, Limits()), 0, CodecSpec(),
                      [[(4,)]])  # fmt: skip
    assert set(link.handlers) == set(protocol.FROM_SYNCER)
    link.wire.close()


def test_pending_answers_are_one_record_each_until_acknowledged():
    pending = PendingAnswers(limit=3)
    bases = [0, 0, 0, 1]  # answer 3 on a later base
    entries = [pending.add(protocol.Answer(answer(s, bases[s]).meta), b"x") for s in range(4)]
    assert list(pending) == [(0, 1, 1), (0, 1, 2), (0, 1, 3)]  # the oldest given up
    entries[1].session, entries[2].session, entries[2].slot = 7, 7, b"slot-2"
    assert pending.not_sent_to(7) == [(0, 1, 3)] and pending.slots() == {b"slot-2"}
    assert pending.by_shared_memory() == [(0, 1, 2)] and pending.slots() == frozenset()
    pending.unsent()
    assert pending.not_sent_to(7) == list(pending)
    assert pending.merged((0, 1, 2)) and list(pending) == [(0, 1, 3)]  # 1 too: base 0
    assert not pending.merged((0, 1, 2))  # not ours any more


def test_the_syncers_orders_outlive_a_reconnect_and_a_stop_wakes_a_waiter(linked):  # noqa: F811
    conn, link = linked
    send(conn, protocol.Ask(final=True), fragment=0, round=4)
    send(conn, protocol.Leave("an operator"))
    serve(conn, 2.0, lambda got: link.asked_to_leave)
    assert link.finishing and link.asked_to_leave and link.take_asks() == {0: 4}
    send(conn, protocol.Rehello())  # back to saying hello (nobody welcomes): orders kept
    deadline = time.monotonic() + 5.0
    while link.state is not LinkState.HELLO and time.monotonic() < deadline:
        time.sleep(0.01)
    assert link.finishing and link.asked_to_leave and not link.await_welcome(0.1)
    send(conn, protocol.Stop())
    assert link.await_welcome(5.0)  # a stop ends the wait for a welcome: there is none
    assert link.stopped and link.state is LinkState.STOPPED


def test_await_welcome_times_out_while_no_syncer_answers():
    address = f"127.0.0.1:{free_port('127.0.0.1')}"  # nobody listens
    wire = Wire(RUN, SECRET, "L0", new_session(), Limits())
    link = SyncerLink(address, wire, 0, CodecSpec(), [[(4,)]])
    link.start()
    link.register(protocol.Hello(wire.session, 0, [0]))
    try:
        assert not link.await_welcome(0.3)
        assert link.state is LinkState.HELLO and not link.stopped
    finally:
        link.close(0.1)


def test_answers_sent_by_shared_memory_go_again_inline_when_the_syncer_cannot_read_them():
    from ddiloco.runtime.processes.transport.shm import ShmWriter

    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    conn = Connections(address, RUN, SECRET, 1, Limits(), shm=False)
    session = new_session()
    wire = Wire(RUN, SECRET, "L0", session, Limits(), shm=ShmWriter(RUN, "L0", session))
    n = 1 << 16  # 128 KiB in bf16: large enough for a shared-memory slot
    link = SyncerLink(address, wire, 0, CodecSpec(), [[(n,)]], silence_seconds=2.0,
                      beat_seconds=0.2)  # fmt: skip
    link.start()
    link.register(protocol.Hello(session, 0, [0]))
    try:
        serve(conn, 10.0, lambda got: link.state is LinkState.LIVE)
        meta = AnswerMeta(0, 1, 0, 0, 3, 0, 1, 1, 64)
        link.push(Answer(meta, [torch.full((n,), 2.0)]))
        got = serve(conn, 5.0, lambda got: bool(kinds(got, "answer")))
        # by /dev/shm (the link thread notes the slot once its send returns, which a loaded
        # machine can put after the syncer's receive: seen under 4 busy processes on 2 cores)
        deadline = time.monotonic() + 5.0
        while link.pending[(0, 1, 0)].slot is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert kinds(got, "answer") and link.pending[(0, 1, 0)].slot is not None
        send(conn, protocol.NoShm())  # the syncer sees another /dev/shm than ours
        got = serve(conn, 5.0, lambda got: bool(kinds(got, "answer")))
        again = kinds(got, "answer")
        assert again and again[0].meta["seq"] == 0 and again[0].payload.nbytes > 1 << 16
        assert link.wire.shm is None and link.fatal is None  # inline from now on
    finally:
        link.close(0.1)
        conn.close()
