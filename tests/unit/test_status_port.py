"""The status page keeps its port across syncer lives (launcher/status_port.py): a later life
asks for the port the last one bound, a port held by another process is not asked for (a free
one is, and its URL replaces the old one), a life that lost the port in between is told apart
from a real failure, and a fixed port is left to the config."""

from __future__ import annotations

import socket

from ddiloco.config import load_config
from ddiloco.runtime.processes.launcher.status_port import StatusPort, port_free, port_of


def up(port: int) -> dict[str, object]:
    return {"kind": "syncer_up", "status_url": f"http://127.0.0.1:{port}/"}


def a_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_later_life_asks_for_the_port_the_last_one_bound(tmp_path):
    status = StatusPort("127.0.0.1:0", tmp_path)
    assert status.args() == []  # the first life: a free port
    port = a_free_port()
    status.heard({"kind": "learner_up"})
    status.heard(up(port))
    args = status.args()
    assert args == ["--set", f'processes.http="127.0.0.1:{port}"']
    config = load_config(None, [args[1]])  # what the syncer reads from it
    assert config.processes.http == f"127.0.0.1:{port}"
    assert status.lost(["ddiloco syncer: error: processes.http='x': cannot bind: in use"])
    assert status.args() == []  # ... so the next life takes a free port
    assert not status.lost(["ddiloco syncer: error: processes.http='x': cannot bind: in use"])


def test_a_port_another_process_holds_is_not_asked_for(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = int(holder.getsockname()[1])
        assert not port_free("127.0.0.1", port)
        status = StatusPort("127.0.0.1:0", tmp_path)
        status.heard(up(port))
        assert status.args() == []  # a free one: its URL is printed and written anew
        assert not status.lost(["ddiloco syncer: error: processes.http='x': cannot bind"])
    assert port_free("127.0.0.1", port)


def test_only_a_bind_failure_of_a_pinned_life_is_the_ports_fault(tmp_path):
    status = StatusPort("127.0.0.1:0", tmp_path)
    status.heard(up(a_free_port()))
    assert status.args() != []
    assert not status.lost(["ddiloco syncer: error: store=...: damaged"])  # a real failure
    assert not status.lost([])


def test_a_run_directory_with_a_status_url_starts_on_its_port(tmp_path):
    port = a_free_port()
    (tmp_path / "status_url").write_text(f"http://127.0.0.1:{port}/\n")
    assert StatusPort("127.0.0.1:0", tmp_path).args()[1].endswith(f':{port}"')
    (tmp_path / "status_url").write_text("garbage\n")
    assert StatusPort("127.0.0.1:0", tmp_path).args() == []


def test_a_fixed_port_or_no_page_is_the_configs(tmp_path):
    for http in ("127.0.0.1:8123", ""):
        status = StatusPort(http, tmp_path)
        status.heard(up(a_free_port()))
        assert status.args() == []
    assert port_of("http://[::1]:8080/") == 8080 and port_of("nonsense") is None
