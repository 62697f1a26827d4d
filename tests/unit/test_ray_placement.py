"""How a service actor rewrites the driver's command line for its node
(``runtime/processes/ray/actor.py: placed_argv``), and its line relay. No cluster needed."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the Ray runtime needs the extra: pip install 'ddiloco[ray]'")

from ddiloco.runtime.processes.ray.actor import Inbox, Lines, Relay, placed_argv

LEARNER = ["learner", "--syncer", "ray:run-syncer", "--id", "1", "--config", "/driver/c.toml"]
SYNCER = ["syncer", "--bind", "NODE:5555", "--config", "/driver/c.toml", "--store", "/s"]
PROXY = ["-m", "ddiloco.runtime.processes.transport.proxy", "--listen", "NODE:5556"]


def test_a_learner_dials_the_named_syncer_and_serves_peers_on_its_node():
    argv = placed_argv(LEARNER, "10.0.0.7", Path("/tmp/x/c.toml"), "10.0.0.5:5555", False)
    assert argv == [
        "learner",
        "--syncer",
        "10.0.0.5:5555",
        "--id",
        "1",
        "--config",
        "/tmp/x/c.toml",
        "--peer-host",
        "10.0.0.7",
    ]


def test_a_given_peer_host_is_kept():
    argv = placed_argv([*LEARNER, "--peer-host", "127.0.0.1"], "10.0.0.7", Path("c"), "a:1", False)
    assert argv[-2:] == ["--peer-host", "127.0.0.1"]


def test_a_learner_ray_restarted_joins_unless_told_how_to_start():
    assert placed_argv(LEARNER, "ip", Path("c"), "a:1", rejoin=True)[-1] == "--join"
    resumed = placed_argv([*LEARNER, "--resume"], "ip", Path("c"), "a:1", rejoin=True)
    assert "--join" not in resumed
    assert "--join" not in placed_argv(LEARNER, "ip", Path("c"), "a:1", rejoin=False)


def test_the_syncer_binds_its_nodes_address_and_never_joins():
    argv = placed_argv(SYNCER, "10.0.0.5", Path("/n/c.toml"), None, rejoin=True)
    assert argv == ["syncer", "--bind", "10.0.0.5:5555", "--config", "/n/c.toml", "--store", "/s"]


def test_the_fault_proxy_listens_on_its_node_and_dials_the_named_syncer():
    argv = placed_argv([*PROXY, "--target", "ray:run-syncer"], "10.0.0.5", Path("c"), "a:1", True)
    assert argv == [*PROXY[:2], "--listen", "10.0.0.5:5556", "--target", "a:1"]


def test_the_inbox_gives_the_proxy_its_commands_as_byte_lines_as_they_come():
    inbox = Inbox()
    inbox.put('{"link": 1, "cut_seconds": 2.0}\n{"link"')
    assert inbox.buffer.readline(1025) == b'{"link": 1, "cut_seconds": 2.0}\n'
    inbox.put(': 0, "factor": 4.0, "seconds": 0}\n')
    assert inbox.buffer.readline(1025) == b'{"link": 0, "factor": 4.0, "seconds": 0}\n'
    inbox.close()
    assert inbox.buffer.readline(1025) == b""  # end of input


def test_a_named_syncer_with_no_address_is_an_error():
    with pytest.raises(RuntimeError, match="no address for ray:run-syncer"):
        placed_argv(LEARNER, "ip", Path("c"), None, False)


def test_the_relay_hands_over_whole_lines_only():
    lines = Lines()
    out = Relay(lines, "out")
    out.write("@event {}\nhalf")
    assert lines.take(0.0) == [("out", "@event {}")]
    out.write(" a line\n")
    assert lines.take(0.0) == [("out", "half a line")]
    assert lines.take(0.01) == []
