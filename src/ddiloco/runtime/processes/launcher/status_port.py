"""The syncer's status page keeps its address across the syncer's lives.

With ``processes.http`` on port 0 (a free port, the default) every syncer life would bind a
new one, and the page a user opened would die with the syncer it showed. So the launcher
starts every later life on the port the latest life bound (its ``syncer_up`` said where),
and a run that finds ``RUN/status_url`` (``--resume``, the next method of ``methods``) starts
on that one. When that port is held by another process now (checked before the start), or
was taken between the check and the syncer's bind (the syncer exits 78 saying ``cannot
bind``: :meth:`StatusPort.lost`), the life takes a free port; its URL is printed and written
to ``RUN/status_url`` as every life's is. A fixed port (``processes.http`` with a port) is
the config's: used as it is, and refused when taken, as before.
"""

from __future__ import annotations

import contextlib
import json
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ddiloco.runtime.processes.transport.sockets import parse_address

URL_FILE = "status_url"  # (report/run_writer.py's note_status_url writes it)


def port_free(host: str, port: int) -> bool:
    """Can a server bind ``host:port`` now (with SO_REUSEADDR, as the status server does, so
    a killed syncer's connections still in TIME_WAIT do not count)?"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.create_server((host, port), family=family):
            return True
    except OSError:
        return False


def port_of(url: str) -> int | None:
    """The port of a status URL (``http://127.0.0.1:8123/``), None if it names none."""
    try:
        return urlsplit(url.strip()).port
    except ValueError:
        return None


class StatusPort:
    """Which port each syncer life's status page binds (see the module). Call order:
    :meth:`args` for every syncer start, :meth:`heard` with every record of the syncer,
    :meth:`lost` when a syncer life exits 78 before it was up."""

    def __init__(self, http: str, out: Path) -> None:
        self.free = False  # processes.http asks for a free port
        self.host, self.prefix = "", ""
        self.port: int | None = None  # the port to ask for (None: a free one)
        self.tried = False  # the current life was started on self.port
        if http:
            self.host, port = parse_address(http, "processes.http")
            self.free, self.prefix = port == 0, http.rpartition(":")[0]
        if self.free:
            with contextlib.suppress(OSError, UnicodeDecodeError):
                self.port = port_of((out / URL_FILE).read_text(encoding="utf-8"))

    def args(self) -> list[str]:
        """What to add to the next syncer life's command: ``--set processes.http=HOST:PORT``
        for the port the page had, if it can be had; nothing for a free port."""
        self.tried = False
        if not self.free or not self.port or not port_free(self.host, self.port):
            return []
        self.tried = True
        address = f"{self.prefix}:{self.port}"
        return ["--set", f"processes.http={json.dumps(address)}"]

    def heard(self, record: dict[str, Any]) -> None:
        """A life said where its page is (``syncer_up``): the next life asks for that port."""
        if record.get("kind") == "syncer_up" and record.get("status_url"):
            self.port = port_of(str(record["status_url"])) or self.port

    def lost(self, log: list[str]) -> bool:
        """Did a life started on the old port fail to bind it (``log``: its last lines)?
        Then the next life takes a free port (restart it at once: no fault of its own)."""
        failed = any("error: processes.http=" in line and "cannot bind" in line for line in log)
        if not (self.tried and failed):
            return False
        self.port, self.tried = None, False
        return True
