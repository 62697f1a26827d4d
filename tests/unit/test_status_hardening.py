"""The syncer's status endpoint against a hostile client, on real sockets: a slowloris cannot
take the process's file descriptors (a server in a subprocess under a low RLIMIT_NOFILE), a
malformed request is a 400 and one log line (never a traceback), another site's Host is
refused (DNS rebinding), a GET flood is refused at its rate while another client is served;
each refusal counted in status.json and /metrics."""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ddiloco.config import ProcessesConfig
from ddiloco.runtime.processes.syncer.actions import ActionGate
from ddiloco.runtime.processes.syncer.status import StatusBoard, StatusServer
from ddiloco.runtime.processes.syncer.status_http import Limits, allowed_host

SNAPSHOT = {"learners": [{"learner": 0, "state": "up", "step": 3}], "rounds": 1}


def serve(
    limits: Limits | None = None, hosts: tuple[str, ...] = ()
) -> tuple[StatusServer, StatusBoard, int]:
    board = StatusBoard("r")
    board.publish(SNAPSHOT)
    gate = ActionGate(bytes(32), ProcessesConfig(http_hosts=hosts))
    server = StatusServer("127.0.0.1:0", board, gate, limits)
    return server, board, int(server.httpd.server_address[1])


def raw(port: int, request: bytes, source: str = "127.0.0.1") -> bytes:
    """Send ``request`` as it is (then end the sending side); the reply, or b"reset" when the
    server closed with the rest of an oversized request unread."""
    chunks = []
    with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) as s:
        try:
            s.sendall(request)
            s.shutdown(socket.SHUT_WR)
            while data := s.recv(65536):
                chunks.append(data)
        except ConnectionResetError:
            return b"".join(chunks) or b"reset"
    return b"".join(chunks)


def code_of(reply: bytes) -> bytes:
    return reply.split(b" ", 2)[1] if reply.startswith(b"HTTP/") else reply


def get(port: int, path: str = "/status.json", host: str | None = None, source: str = "127.0.0.2"):
    """(status, body) of a GET from ``source`` (a loopback address of its own)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    c.putrequest("GET", path, skip_host=host is not None)
    if host is not None:
        c.putheader("Host", host)
    c.endheaders()
    reply = c.getresponse()
    out = reply.status, reply.read()
    c.close()
    return out


@pytest.mark.parametrize(
    ("host", "verdict"),
    [
        ("127.0.0.1:8080", True),
        ("[::1]:80", True),
        ("10.1.2.3", True),  # an IP literal: no DNS to rebind
        ("localhost:5", True),
        ("LOCALHOST.", True),
        ("status.localhost", True),
        ("status.example.org", True),  # configured
        ("evil.example.com:8080", False),
        ("example.org", False),
        ("", None),
        ("a b", None),
        ("host:99999", None),
        ("[::zz]", None),
        ("h\u00b2", None),
    ],
)
def test_the_host_header_is_an_ip_localhost_or_a_configured_name(host, verdict):
    assert allowed_host(host, {"status.example.org"}) is verdict


def test_a_slowloris_cannot_take_the_process_file_descriptors(tmp_path):
    """The server in a subprocess under RLIMIT_NOFILE 256; 400 half-open connections from 50
    addresses: the server holds at most its 64, refuses the rest at once, still opens files,
    drops the held ones after ``seconds`` (8 here), and then answers a normal client."""
    child = textwrap.dedent(
        """
        import os, resource, sys
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        from ddiloco.config import ProcessesConfig
        from ddiloco.runtime.processes.syncer.actions import ActionGate
        from ddiloco.runtime.processes.syncer.status import StatusBoard, StatusServer
        from ddiloco.runtime.processes.syncer.status_http import Limits
        board = StatusBoard("r")
        board.publish({"learners": [], "rounds": 0})
        server = StatusServer("127.0.0.1:0", board, ActionGate(bytes(32), ProcessesConfig()),
                              Limits(seconds=8.0, rate=1000.0, burst=1000.0))
        print(server.httpd.server_address[1], flush=True)
        for line in sys.stdin:
            files = [open(os.devnull) for _ in range(32)]  # (a ledger write still works)
            for f in files:
                f.close()
            board.publish({"learners": [], "rounds": 0})
            print(len(os.listdir("/proc/self/fd")), server.httpd.open_connections(),
                  board.rendered("json").decode(), flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    held: list[socket.socket] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())

        def ask() -> tuple[int, int, dict]:
            proc.stdin.write("?\n")
            proc.stdin.flush()
            fds, open_, status = proc.stdout.readline().split(" ", 2)
            return int(fds), int(open_), json.loads(status)

        base_fds = ask()[0]
        for i in range(400):  # a request line and half a header, never finished
            s = socket.socket()
            s.bind((f"127.0.0.{10 + i % 50}", 0))
            s.settimeout(5)
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET /status.json HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            held.append(s)
        time.sleep(0.5)
        fds, open_, status = ask()
        assert open_ <= 64 and fds <= base_fds + 64 + 4, (fds, open_)
        assert status["http"]["busy"] + status["http"].get("busy_client", 0) >= 400 - 64
        deadline = time.monotonic() + 20
        while ask()[1] > 0 and time.monotonic() < deadline:  # the reaper drops the slow ones
            time.sleep(0.2)
        fds, open_, status = ask()
        assert open_ == 0 and status["http"]["slow"] == 64, status["http"]
        assert get(port)[0] == 200  # the page answers a normal client again
    finally:
        for s in held:
            s.close()
        proc.kill()
        proc.wait()
        err = proc.stderr.read() if proc.stderr else ""
    assert "Traceback" not in err, err
    assert err.count("refused busy") <= 2 and "refused slow" in err  # (rate-limited lines)


def test_one_client_cannot_hold_every_connection():
    server, board, port = serve(Limits(seconds=30.0, rate=1000.0, burst=1000.0))
    held = []
    try:
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET / HTTP/1.1\r\n")
            held.append(s)
        time.sleep(0.3)
        assert server.httpd.open_connections() == 8  # its per-client share
        assert get(port, source="127.0.0.2")[0] == 200  # another address is served at once
        assert board.refused.snapshot() == {"busy_client": 12}
    finally:
        for s in held:
            s.close()
        server.close()


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /learners/0/kill HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: \xc2\xb2\r\n\r\n",
        b"POST /learners/0/kill HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: \xb2\r\n\r\n",
        b"POST /learners/0/kill HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1\r\n"
        b"Content-Length: 2\r\n\r\n",
        b"POST /learners/0/kill HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1e3\r\n\r\n",
        b"GET /\xff\x00 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET status.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET / HTTP/1.1\r\n\r\n",  # no Host
        b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1:99999999\r\n\r\n",
        b"GET / HTTP/9.9\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET / HTTP/1.1 extra\r\n\r\n",
        b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n",
        b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64),  # a TLS hello
    ],
    ids=[
        "length-superscript-utf8",
        "length-superscript-latin1",
        "length-twice",
        "length-float",
        "path-binary",
        "path-relative",
        "no-host",
        "host-twice",
        "host-bad-port",
        "version-9.9",
        "request-line-4-words",
        "request-line-70k",
        "header-70k",
        "headers-200",
        "tls-hello",
    ],
)
def test_malformed_requests_are_a_400_and_one_log_line_never_a_traceback(
    request_bytes, caplog, capfd
):
    server, board, port = serve()
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(20):
                code = code_of(raw(port, request_bytes))
                assert code in (b"400", b"414", b"431", b"505", b"reset"), code[:80]
        code, body = get(port)
        assert code == 200 and json.loads(body)["rounds"] == 1  # unharmed
    finally:
        server.close()
    assert board.refused.snapshot() == {"malformed": 20}  # each one counted ...
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Traceback" not in caplog.text
    lines = [r for r in caplog.records if "status page refused" in r.getMessage()]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]  # ... and logged once per 5 s


def test_counts_reach_status_json_and_metrics():
    server, board, port = serve()
    try:
        raw(port, b"POST /learners/0/kill HTTP/1.1\r\nHost: ::1\r\n\r\n")
        assert get(port, host="evil.example.com:8080")[0] == 421
        board.publish(SNAPSHOT)
        status = json.loads(get(port)[1])
        assert status["http"] == {"host": 1, "malformed": 1}
        metrics = get(port, "/metrics")[1].decode()
        assert 'ddiloco_http_refused_total{reason="host"} 1.0' in metrics
    finally:
        server.close()


def test_another_sites_host_is_refused_and_a_configured_one_served():
    server, board, port = serve(hosts=("status.example.org",))
    try:
        code, body = get(port, host="rebind.attacker.example:8080")
        assert code == 421 and b"peer" not in body and b"learners" not in body
        assert get(port, "/", host="rebind.attacker.example")[0] == 421
        assert get(port, host="status.example.org")[0] == 200
        assert get(port, host="localhost:1234")[0] == 200
        assert get(port)[0] == 200  # (http.client sends 127.0.0.1:PORT)
    finally:
        server.close()
    assert board.refused.snapshot() == {"host": 2}


def test_a_get_flood_is_refused_at_its_rate_while_another_client_is_served():
    """Two flooding threads from 127.0.0.1 (as fast as they can, 3 s); a client on 127.0.0.2
    asks every 0.1 s and is always served; the flood gets its rate and 429s beyond it."""
    server, board, port = serve()
    stop = time.monotonic() + 3.0
    codes: dict[bytes, int] = {}
    lock = threading.Lock()

    def flood() -> None:
        while time.monotonic() < stop:
            try:
                code = code_of(raw(port, b"GET /status.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"))
            except OSError:
                code = b"reset"
            with lock:
                codes[code] = codes.get(code, 0) + 1

    threads = [threading.Thread(target=flood) for _ in range(2)]
    for t in threads:
        t.start()
    served = []
    try:
        while time.monotonic() < stop:
            served.append(get(port)[0])
            time.sleep(0.1)
    finally:
        for t in threads:
            t.join()
        server.close()
    assert served and set(served) == {200}, served
    limits = Limits()
    assert codes.get(b"200", 0) <= limits.burst + 3.5 * limits.rate, codes  # its rate, no more
    assert codes.get(b"429", 0) + codes.get(b"reset", 0) > codes.get(b"200", 0), codes
    assert board.refused.snapshot()["rate"] >= codes.get(b"429", 0)


def test_the_page_renders_its_json_once_per_publish():
    server, board, port = serve()
    try:
        bodies = {get(port)[1] for _ in range(10)}
        first = board.rendered("json")
        assert board.rendered("json") is first and len(bodies) == 1  # (the same bytes)
        board.publish({**SNAPSHOT, "rounds": 2})
        assert board.rendered("json") is not first and json.loads(get(port)[1])["rounds"] == 2
    finally:
        server.close()


if os.name != "posix":  # (RLIMIT_NOFILE, /proc and 127.0.0.x sources are Linux's)
    pytestmark = pytest.mark.skip("Linux only")
