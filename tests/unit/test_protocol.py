"""The protocol: every message kind survives the trip through its own ``meta``/``parse`` and
the wire's encoding, a malformed field is refused naming it, and both ends have a handler for
every kind the other sends."""

from __future__ import annotations

import pytest

from ddiloco.core.rounds import AnswerMeta
from ddiloco.errors import ConfigError
from ddiloco.runtime.processes import protocol
from ddiloco.runtime.processes.syncer.answers import Answers
from ddiloco.runtime.processes.syncer.service import SyncerService
from ddiloco.runtime.processes.transport.wire import Limits, Wire

FRAGMENTS = 3
ANSWER = AnswerMeta(
    learner=1, incarnation=7, seq=4, fragment=2, round_id=5, base_version=3, local_step=9,
    c_steps=6, c_tokens=768,
)  # fmt: skip
EXAMPLES: list[protocol.Message] = [
    protocol.Hello(7, 12, [1, 0, 2], "127.0.0.1:4100"),
    protocol.Hello(7, 12, [1, 0, 2], "127.0.0.1:4100 127.0.0.1:4101", ranks=2),  # sharded
    protocol.Progress(7, 13, 256, 0.25, [0, 2], (1024, [1, 0, 1])),
    protocol.Progress(7, 13, 256, 0.25, []),
    protocol.Progress(7, 13, 256, 0.25, [1], loss=3.25),
    protocol.Answer(ANSWER, (1024, [1, 0, 1])),
    protocol.Answer(ANSWER),
    protocol.Answer(ANSWER, (1024, [1, 0, 1]), ranks=2),  # rank 0's part
    protocol.AnswerPart((1, 2, 3), 1, 1, 2),
    protocol.PartHello(3, 4, [1, 0, 2]),
    protocol.Beat(),
    protocol.Beat(live=False),
    protocol.Inline(),
    protocol.AskPeers(),
    protocol.Bye("SIGTERM"),
    protocol.Proof("abc123"),
    protocol.Welcome(40, [3, 3, 2]),
    protocol.Ask(final=True),
    protocol.Ask(),
    protocol.Fragment(4, [(1, 7, 4), (0, 3, 9)]),
    protocol.Verdict((1, 7, 4), "stale"),
    protocol.Rehello(),
    protocol.Peers({"2": "127.0.0.1:4102", "0": "10.0.0.1:4100"}, [3, 3, 2]),
    protocol.Peers({}),
    protocol.Stop(),
    protocol.Leave("an operator at 127.0.0.1"),
    protocol.Kill("an operator at 127.0.0.1"),
    protocol.Refused("learner 1 holds fragment 0 at version 9"),
    protocol.NoShm(),
    protocol.Challenge("n0nce"),
]


def test_every_kind_has_an_example_and_one_class():
    assert {type(m) for m in EXAMPLES} == set(protocol.KINDS)
    kinds = [(k.KIND, f) for k in protocol.KINDS for f in k.FROM]
    assert len(kinds) == len(set(kinds))  # one class per kind and direction


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_a_message_is_what_its_receiver_parses_after_the_wire(message):
    sender = "S" if "syncer" in message.FROM else "L1"
    a = Wire("run", b"k" * 32, sender, 11, Limits())
    b = Wire("run", b"k" * 32, "S" if sender != "S" else "L1", 12, Limits())
    parts = a.encode(message.KIND, learner=1, to=12, meta=message.meta())
    header = b.decode([bytes(p) for p in parts]).header
    assert header.kind == message.KIND
    assert type(message).parse(header.meta, FRAGMENTS) == message


@pytest.mark.parametrize(
    ("kind", "meta", "field"),
    [
        (protocol.Hello, {"inc": 1, "step": -1, "versions": [0, 0, 0]}, "meta.step"),
        (protocol.Hello, {"inc": 1, "step": 0, "versions": [0, 0]}, "meta.versions"),
        (protocol.Progress, {"inc": 1, "step": 1, "tokens": 1, "secs": float("nan")}, "meta.secs"),
        (protocol.Progress, {"inc": 1, "step": 1, "tokens": 1, "secs": 0, "rebased": [3]},
         "meta.rebased"),
        (protocol.Progress, {"inc": 1, "step": 1, "tokens": 1, "secs": 0, "loss": float("inf")},
         "meta.loss"),
        (protocol.Progress, {"inc": 1, "step": 1, "tokens": 1, "secs": 0, "loss": -1.0},
         "meta.loss"),
        (protocol.Progress, {"inc": 1, "step": 1, "tokens": 1, "secs": 0, "loss": "3"},
         "meta.loss"),
        (protocol.Answer, {**ANSWER.__dict__, "fragment": 3}, "meta.fragment"),
        (protocol.Answer, {**ANSWER.__dict__, "c_tokens": True}, "meta.c_tokens"),
        (protocol.Answer, {**ANSWER.__dict__, "ranks": 1}, "meta.ranks"),
        (protocol.AnswerPart, {"key": [1, 2, 3], "fragment": 0, "rank": 0, "ranks": 2},
         "meta.rank"),
        (protocol.AnswerPart, {"key": [1, 2, 3], "fragment": 0, "rank": 2, "ranks": 2},
         "meta.rank"),
        (protocol.AnswerPart, {"key": [1, 2, 3], "fragment": 9, "rank": 1, "ranks": 2},
         "meta.fragment"),
        (protocol.Hello, {"inc": 1, "step": 0, "versions": [0] * 3, "ranks": 1}, "meta.ranks"),
        (protocol.PartHello, {"rank": 0, "ranks": 2, "versions": [0] * 3}, "meta.rank"),
        (protocol.PartHello, {"rank": 1, "ranks": 2, "versions": [0] * 2}, "meta.versions"),
        (protocol.Beat, {"live": 1}, "meta.live"),
        (protocol.Bye, {"why": "x" * 1000}, "meta.why"),
        (protocol.Welcome, {"global_step": 1, "versions": [1]}, "meta.versions"),
        (protocol.Fragment, {"version": 1, "keys": [[1, 2]]}, "meta.key"),
        (protocol.Verdict, {"key": [1, 2, -3], "verdict": "stale"}, "meta.key"),
        (protocol.Peers, {"peers": {"x": "127.0.0.1:1"}}, "meta.peers"),
        (protocol.Peers, {"peers": {"1": 5}}, "meta.peers"),
        (protocol.Challenge, {"nonce": 5}, "meta.nonce"),
    ],
)  # fmt: skip
def test_a_malformed_field_is_refused_by_name(kind, meta, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        kind.parse(meta, FRAGMENTS)


def test_the_syncer_handles_every_kind_a_learner_sends():
    # the syncer's handlers are its on_<kind> methods; a proof is the connections' own
    syncer_kinds = {
        n.removeprefix("on_")
        for c in (SyncerService, Answers)
        for n in dir(c)
        if n.startswith("on_")
    }
    assert set(protocol.FROM_LEARNER) - {"proof"} == syncer_kinds
    # (the link's own table: tests/unit/test_link.py)
