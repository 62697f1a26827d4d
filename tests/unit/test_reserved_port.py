"""The launcher keeps the syncer's port reserved for the run (Linux): no other process on
the host gets it from the kernel, while the syncer (zmq) binds it, again after a restart."""

from __future__ import annotations

import socket
import sys

import pytest
import zmq

from ddiloco.runtime.processes.launcher.fragments import free_port


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's SO_REUSEADDR")
def test_a_reserved_port_goes_to_no_one_else_but_the_syncer_binds_it():
    held: list[socket.socket] = []
    port = free_port("127.0.0.1", held)
    try:
        assert len(held) == 1
        others = set()
        for _ in range(3000):  # what torchrun's rendezvous or a snapshot server would get
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                others.add(s.getsockname()[1])
        assert port not in others
        for _ in range(2):  # the syncer, then the syncer restarted (a process of its own)
            ctx = zmq.Context()
            try:
                ctx.socket(zmq.ROUTER).bind(f"tcp://127.0.0.1:{port}")
            finally:
                ctx.destroy(linger=0)  # (closes its sockets, then ends)
    finally:
        for s in held:
            s.close()


def test_without_a_list_the_port_is_only_found():
    port = free_port("127.0.0.1")
    with socket.socket() as s:  # nothing holds it
        s.bind(("127.0.0.1", port))
