"""The gatekeeper: who may complete a handshake, and what failing ones may cost."""

from __future__ import annotations

import zmq

from ddiloco.runtime.processes.transport.auth import Bounds, Gatekeeper, credential, learner_of

SECRET = b"g" * 32


def request(name: bytes, password: bytes, address: bytes = b"10.0.0.9") -> list[bytes]:
    return [b"1.0", b"7", b"ddiloco", address, b"", b"PLAIN", name, password]


def gatekeeper(now: list[float]) -> tuple[zmq.Context, Gatekeeper]:
    ctx: zmq.Context = zmq.Context()
    bounds = Bounds(burst=4, per_second=1.0, fail_limit=3, fail_window=10.0, ban_seconds=30.0)
    accept = lambda name: learner_of(name) is not None and learner_of(name) < 2  # noqa: E731
    return ctx, Gatekeeper(ctx, SECRET, "run", accept, bounds, clock=lambda: now[0])


def test_only_the_run_secret_and_a_member_name_complete_a_handshake():
    now = [0.0]
    ctx, gate = gatekeeper(now)
    try:
        good = gate.decide(request(b"L1", credential(SECRET, "run", "L1")))
        assert good[2:5] == [b"200", b"OK", b"L1"]  # the user id every message then carries
        assert gate.decide(request(b"L1", credential(SECRET, "other", "L1")))[2] == b"400"
        assert gate.decide(request(b"L1", credential(b"h" * 32, "run", "L1")))[2] == b"400"
        assert gate.decide(request(b"L7", credential(SECRET, "run", "L7")))[2] == b"400"
        assert gate.decide(request(b"L0", credential(SECRET, "run", "L1")))[2] == b"400"
        assert gate.decide([b"1.0", b"8", b"ddiloco", b"a", b"", b"NULL"])[2] == b"400"
        assert gate.counts["refused_bad_credentials"] >= 2
        assert gate.counts["refused_unknown_name"] == 1
    finally:
        gate.sock.close(0)
        ctx.term()


def test_a_failing_address_is_shut_out_but_a_learner_sharing_it_still_gets_in():
    now = [0.0]
    ctx, gate = gatekeeper(now)
    try:
        for _ in range(3):
            gate.decide(request(b"L0", b"guess"))
        assert (
            gate.decide(request(b"L0", b"guess"))[3] == b"address shut out after repeated failures"
        )
        assert gate.counts["refused_banned"] == 1
        ok = gate.decide(request(b"L0", credential(SECRET, "run", "L0")))  # same address
        assert ok[2] == b"200"
        now[0] = 31.0  # the ban expires
        assert gate.decide(request(b"L0", b"guess"))[3] == b"wrong secret or run id"
    finally:
        gate.sock.close(0)
        ctx.term()
