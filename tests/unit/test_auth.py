"""The gatekeeper: who may complete a handshake, and what failing ones may cost."""

from __future__ import annotations

import time

import zmq

from ddiloco.runtime.processes.transport.auth import (
    Bounds,
    Gatekeeper,
    credential,
    learner_of,
    link_name,
    link_of,
)
from ddiloco.runtime.processes.transport.tickets import TicketBook, make_ticket, parse_ticket

SECRET = b"g" * 32
WALL = 1_800_000_000.0  # the wall clock the tickets are made and checked on


def request(name: bytes, password: bytes, address: bytes = b"10.0.0.9") -> list[bytes]:
    return [b"1.0", b"7", b"ddiloco", address, b"", b"PLAIN", name, password]


def ticket(name: str, secret: bytes = SECRET, run: str = "run", at: float = WALL):
    """A one-time username and its password, as ``present`` makes them."""
    user = make_ticket(name, at)
    return user.encode(), credential(secret, run, user)


def gatekeeper(now: list[float], tickets: TicketBook | None = None):
    ctx: zmq.Context = zmq.Context()
    bounds = Bounds(burst=4, per_second=1.0, fail_limit=3, fail_window=10.0, ban_seconds=30.0)
    accept = lambda name: learner_of(name) is not None and learner_of(name) < 2  # noqa: E731
    tickets = tickets or TicketBook(wall=lambda: WALL)
    gate = Gatekeeper(ctx, SECRET, "run", accept, bounds, clock=lambda: now[0], tickets=tickets)
    return ctx, gate


def test_only_the_run_secret_and_a_member_name_complete_a_handshake():
    now = [0.0]
    ctx, gate = gatekeeper(now)
    try:
        good = gate.decide(request(*ticket("L1")))
        assert good[2:5] == [b"200", b"OK", b"L1"]  # the user id every message then carries
        assert gate.decide(request(*ticket("L1", run="other")))[2] == b"400"
        assert gate.decide(request(*ticket("L1", secret=b"h" * 32)))[2] == b"400"
        assert gate.decide(request(*ticket("L7")))[2] == b"400"
        user, password = ticket("L1")
        assert gate.decide(request(user.replace(b"L1", b"L0", 1), password))[2] == b"400"
        assert gate.decide(request(b"L1", credential(SECRET, "run", "L1")))[2] == b"400"  # v1
        assert gate.decide([b"1.0", b"8", b"ddiloco", b"a", b"", b"NULL"])[2] == b"400"
        assert gate.counts["refused_bad_credentials"] >= 2
        assert gate.counts["refused_unknown_name"] == 1
        assert gate.counts["refused_not_a_ticket"] + gate.counts["refused_banned"] >= 1
        assert sum(n for k, n in gate.counts.items() if k.startswith("refused_")) == 6
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
        ok = gate.decide(request(*ticket("L0")))  # same address
        assert ok[2] == b"200"
        now[0] = 31.0  # the ban expires
        assert gate.decide(request(ticket("L0")[0], b"guess"))[3] == b"wrong secret or run id"
    finally:
        gate.sock.close(0)
        ctx.term()


# -- one-time tickets ---------------------------------------------------------------------------
def test_a_ticket_is_admitted_once_and_only_near_the_servers_clock():
    ctx, gate = gatekeeper([0.0])
    try:
        user, password = ticket("L0")
        assert gate.decide(request(user, password))[2] == b"200"
        again = gate.decide(request(user, password, address=b"10.6.6.6"))  # a replayed capture
        assert again[2:4] == [b"400", b"a connection ticket used before (a replayed capture?)"]
        assert gate.decide(request(*ticket("L0", at=WALL - 301)))[3].startswith(b"a ticket whose")
        assert gate.decide(request(*ticket("L0", at=WALL + 301)))[2] == b"400"  # clock ahead
        assert gate.decide(request(*ticket("L0", at=WALL - 299)))[2] == b"200"  # within skew
        assert gate.counts["refused_replayed"] == 1 and gate.counts["refused_clock"] == 2
    finally:
        gate.sock.close(0)
        ctx.term()


def test_the_syncers_journal_makes_a_restarted_server_refuse_an_earlier_lifes_ticket(tmp_path):
    import pytest

    from ddiloco.runtime.processes.transport.tickets import RECORD, TicketError

    path = tmp_path / "tickets.bin"
    wall = [WALL]
    first = TicketBook(path, wall=lambda: wall[0])
    user, password = ticket("L0")
    old_user, old_password = ticket("L1", at=WALL - 200)
    for u, p in ((user, password), (old_user, old_password)):
        ctx, gate = gatekeeper([0.0], first)
        assert gate.decide(request(u, p))[2] == b"200"
        gate.sock.close(0)
        ctx.term()
    assert path.stat().st_mode & 0o777 == 0o600 and path.stat().st_size == 2 * RECORD.size
    wall[0] = WALL + 150  # a new life, 150 s later: the L1 ticket (200 + 150 s old) expired
    ctx, gate = gatekeeper([0.0], TicketBook(path, wall=lambda: wall[0]))
    try:
        assert gate.decide(request(user, password))[3].startswith(b"a connection ticket used")
        assert gate.decide(request(old_user, old_password))[3].startswith(b"a ticket whose")
        assert path.stat().st_size == RECORD.size  # compacted to the live ones
    finally:
        gate.sock.close(0)
        ctx.term()
    path.write_bytes(path.read_bytes() + b"torn")
    with pytest.raises(TicketError, match=r"tickets\.bin.*damaged"):
        TicketBook(path, wall=lambda: wall[0])


def test_a_spent_ticket_is_renewed_and_a_refused_fresh_one_is_fatal():
    """Real sockets: zmq reconnects with the ticket a socket was given; the server refuses it
    (used), and the watch tells the owner to renew instead of stopping."""
    from ddiloco.runtime.processes.transport.auth import HandshakeWatch, present, serve_plain

    ctx: zmq.Context = zmq.Context()
    gate = Gatekeeper(ctx, SECRET, "run", lambda name: name == "L0")
    gate.start()
    server = ctx.socket(zmq.ROUTER)
    serve_plain(server)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = ctx.socket(zmq.DEALER)
    present(client, SECRET, "run", "L0")
    watch = HandshakeWatch(client, f"127.0.0.1:{port}")
    client.connect(f"tcp://127.0.0.1:{port}")
    wrong = ctx.socket(zmq.DEALER)
    present(wrong, b"h" * 32, "run", "L0")
    wrong_watch = HandshakeWatch(wrong, "the server")
    wrong.connect(f"tcp://127.0.0.1:{port}")
    try:
        client.send(b"hi")
        assert server.poll(5000) and server.recv_multipart()[1] == b"hi"
        server.close(0)  # the server restarts on the same port: the connection closes
        server = ctx.socket(zmq.ROUTER)
        serve_plain(server)
        deadline = time.monotonic() + 5
        while True:  # zmq closes the old socket asynchronously: the port frees in a moment
            try:
                server.bind(f"tcp://127.0.0.1:{port}")
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline, f"port {port} never freed"
                time.sleep(0.05)
        deadline = time.monotonic() + 5
        while not watch.renew and time.monotonic() < deadline:
            assert watch.poll() is None
            time.sleep(0.02)
        assert watch.renew and watch.admitted
        fatal = None
        while fatal is None and time.monotonic() < deadline:
            fatal = wrong_watch.poll()
            time.sleep(0.02)
        assert fatal is not None and "wrong secret or run id" in fatal
    finally:
        watch.close()
        wrong_watch.close()
        for sock in (client, wrong, server):
            sock.close(0)
        gate.close()
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


def test_a_link_name_says_its_learner_and_rank_and_survives_a_ticket():
    """Rank r >= 1 of a sharded learner authenticates as ``L<m>r<r>``; the ticket's fields
    are dot-separated, so the name must hold no dot (``L1.1`` once made every rank link's
    handshake fail)."""
    for m, r in [(0, 0), (3, 0), (3, 1), (12, 7)]:
        name = link_name(m, r)
        assert link_of(name) == (m, r)
        assert parse_ticket(make_ticket(name)) is not None
        assert parse_ticket(make_ticket(name))[0] == name
    assert learner_of("L3r1") is None  # not the learner's own link
    for bad in ("L3r0", "L3.1", "L3r", "Lr1", "S", "L3r01", "L1234567r1", None):
        assert link_of(bad) is None, bad
