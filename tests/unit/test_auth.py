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


# -- the run secret as a user gives it ----------------------------------------------------------
def test_a_guessable_secret_is_refused_by_name(monkeypatch):
    import pytest

    from ddiloco.errors import ConfigError
    from ddiloco.runtime.processes.transport.sockets import SECRET_ENV, load_secret

    monkeypatch.setenv(SECRET_ENV, bytes(range(32)).hex())
    assert load_secret(None) == bytes(range(32))
    for guessable in (bytes(32), b"ab" * 16, bytes(range(7)) * 5):
        monkeypatch.setenv(SECRET_ENV, guessable.hex())
        with pytest.raises(ConfigError, match=r"distinct byte values.*not random"):
            load_secret(None)


def test_a_secret_file_that_is_not_a_private_regular_file_is_refused_at_once(tmp_path):
    import os
    import threading
    import time

    import pytest

    from ddiloco.errors import ConfigError
    from ddiloco.runtime.processes.transport.sockets import load_secret

    good = tmp_path / "run.secret"
    good.write_text(bytes(range(32)).hex() + "\n")
    good.chmod(0o600)
    assert load_secret(str(good)) == bytes(range(32))
    fifo = tmp_path / "fifo.secret"
    os.mkfifo(fifo, 0o600)
    started = time.monotonic()
    done: list[BaseException] = []
    reader = threading.Thread(target=lambda: done.append(_raised(load_secret, str(fifo))))
    reader.daemon = True  # (if it hung, the test fails below, not the session)
    reader.start()
    reader.join(5)
    assert done and isinstance(done[0], ConfigError) and "not a regular file" in str(done[0])
    assert time.monotonic() - started < 5
    big = tmp_path / "big.secret"
    big.write_bytes(os.urandom(1 << 20))
    big.chmod(0o600)
    with pytest.raises(ConfigError, match="not a secret"):
        load_secret(str(big))
    good.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_secret(str(good))
    with pytest.raises(ConfigError, match="cannot read"):
        load_secret(str(tmp_path / "missing"))


def _raised(fn, *args) -> BaseException | None:
    try:
        fn(*args)
    except BaseException as exc:  # handed to the test's thread
        return exc
    return None
