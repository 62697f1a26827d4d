"""The status page's actions: only with the run secret, only on loopback unless turned on,
only for a learner the syncer knows; every refusal counted; nothing queued but what passed."""

from __future__ import annotations

import pytest

from ddiloco.config import ProcessesConfig
from ddiloco.runtime.processes.syncer.actions import ActionGate

SECRET = bytes(range(32))
BEARER = f"Bearer {SECRET.hex()}"


def gate(http: str = "127.0.0.1:0", actions: str = "auto") -> ActionGate:
    return ActionGate(SECRET, ProcessesConfig(http=http, http_actions=actions))


def sent(g: ActionGate) -> list[tuple[int, str, dict[str, str]]]:
    out: list[tuple[int, str, dict[str, str]]] = []
    g.carry_out(lambda m, msg: out.append((m, msg.KIND, msg.meta())), lambda *a, **k: None)
    return out


def test_the_secret_is_needed_and_compared_whole():
    g = gate()
    assert g.post("/learners/1/kill", None, "1.2.3.4", {0, 1})[0] == 401
    assert g.post("/learners/1/kill", "Basic abc", "1.2.3.4", {0, 1})[0] == 401
    assert g.post("/learners/1/kill", "Bearer " + "00" * 32, "1.2.3.4", {0, 1})[0] == 403
    assert g.post("/learners/1/kill", BEARER[:-2], "1.2.3.4", {0, 1})[0] == 403
    assert sent(g) == []
    assert g.counts == {"refused_no_secret": 2, "refused_bad_secret": 2}
    code, reply = g.post("/learners/1/kill", BEARER.upper().replace("BEARER", "bearer"), "h", {1})
    assert (code, reply) == (202, {"accepted": "kill", "learner": 1})  # hex in any case
    assert sent(g) == [(1, "kill", {"why": "an operator at h"})]
    assert sent(g) == []  # sent once


@pytest.mark.parametrize(
    ("path", "learners", "code"),
    [
        ("/learners/7/leave", {0, 1}, 404),  # not known to the syncer
        ("/learners/1/explode", {0, 1}, 404),
        ("/learners/x/kill", {0, 1}, 404),
        ("/kill?learner=1", {0, 1}, 404),
        ("/learners/1/leave?x=1", {0, 1}, 202),
    ],
)
def test_only_known_actions_on_known_learners(path, learners, code):
    g = gate()
    assert g.post(path, BEARER, "h", learners)[0] == code
    assert len(sent(g)) == (code == 202)


@pytest.mark.parametrize(
    ("http", "setting", "enabled"),
    [
        ("127.0.0.1:0", "auto", True),
        ("[::1]:8080", "auto", True),
        ("localhost:0", "auto", True),
        ("0.0.0.0:8080", "auto", False),
        ("10.0.0.5:8080", "auto", False),
        ("10.0.0.5:8080", "on", True),
        ("127.0.0.1:0", "off", False),
    ],
)
def test_actions_are_off_beyond_loopback_unless_turned_on(http, setting, enabled):
    g = gate(http, setting)
    assert g.enabled is enabled
    code, reply = g.post("/learners/0/kill", BEARER, "h", {0})
    assert code == (202 if enabled else 403)
    if not enabled:
        assert "actions are off" in str(reply["error"])


def test_the_endpoint_answers_malformed_posts_with_an_error_and_queues_a_good_one():
    import http.client

    from ddiloco.runtime.processes.syncer.status import StatusBoard, StatusServer

    board, g = StatusBoard("r"), gate()
    board.publish({"learners": [{"learner": 0}, {"learner": 1}], "rounds": 0})
    server = StatusServer("127.0.0.1:0", board, g)
    host, port = server.httpd.server_address[:2]

    def post(path: str, headers: dict[str, str]) -> int:
        c = http.client.HTTPConnection(str(host), int(port), timeout=5)
        c.putrequest("POST", path)
        for k, v in headers.items():
            c.putheader(k, v)
        c.endheaders()
        code = c.getresponse().status
        c.close()
        return code

    try:
        for length in ("abc", "-5", "99999999"):
            assert (
                post("/learners/1/kill", {"Content-Length": length, "Authorization": BEARER}) == 400
            )
        assert post("/learners/1/leave", {"Content-Length": "0"}) == 401
        assert post("/learners/1/leave", {"Content-Length": "0", "Authorization": BEARER}) == 202
    finally:
        server.close()
    assert sent(g) == [(1, "leave", {"why": "an operator at 127.0.0.1"})]
