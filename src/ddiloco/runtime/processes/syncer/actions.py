"""What an operator may do from the syncer's status page: kill a learner or make it leave.

``POST /learners/<m>/kill`` makes learner ``m`` crash on purpose (it exits non-zero, as a
real crash does; its launcher restarts it, and it comes back from a peer), the way torchft's
lighthouse lets one test a job's recovery; ``POST /learners/<m>/leave`` makes it leave
cleanly (a goodbye; not restarted). Each needs the run secret as a bearer token
(``Authorization: Bearer <secret in hex>``, what ``$DDILOCO_SECRET`` holds), compared in
constant time; a request without it, or with another, is refused and counted, and nothing
is sent. ``processes.http_actions``: ``auto`` (the default) allows them only while the
endpoint binds a loopback address, since plain HTTP carries the secret in clear text; ``on``
allows them on any bind (put TLS in front), ``off`` never.

Threads: the HTTP thread calls :meth:`ActionGate.post` and only queues what it accepts; the
service's thread sends what was queued with :meth:`ActionGate.carry_out`.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import queue
import re
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from ddiloco.config import ProcessesConfig
from ddiloco.runtime.processes import protocol

ACTIONS = ("kill", "leave")
_PATH = re.compile(r"^/learners/(\d{1,6})/([a-z]+)$")


@dataclass(frozen=True)
class ActionRequest:
    learner: int
    action: str
    client: str  # the requester's address, for the run's records


def loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class ActionGate:
    """Checks, counts and queues the page's requests (see the module)."""

    def __init__(self, secret: bytes, config: ProcessesConfig) -> None:
        setting = config.http_actions
        bind_host = config.http.rpartition(":")[0].strip("[]")
        self.token = secret.hex().encode()
        self.enabled = setting == "on" or (setting == "auto" and loopback(bind_host))
        self.why_off = (
            "actions are off (processes.http_actions = 'off')"
            if setting == "off"
            else f"actions are off on a non-loopback bind ({bind_host}): "
            "set processes.http_actions = 'on' behind TLS"
        )
        # (the endpoint's other setting: the names its Host header may carry, status_http)
        self.hosts = frozenset(h.lower().rstrip(".") for h in config.http_hosts)
        self.counts: Counter[str] = Counter()
        self._requests: queue.SimpleQueue[ActionRequest] = queue.SimpleQueue()
        self._lock = threading.Lock()

    def post(
        self, path: str, authorization: str | None, client: str, learners: set[int]
    ) -> tuple[int, dict[str, object]]:
        """The HTTP status and JSON body for ``POST path`` (``learners``: those the latest
        snapshot lists)."""
        match = _PATH.match(path.split("?", 1)[0])
        if match is None or match.group(2) not in ACTIONS:
            return self._refuse("unknown", 404, f"no such action: POST /learners/<m>/{ACTIONS}")
        m, action = int(match.group(1)), match.group(2)
        if not self.enabled:
            return self._refuse("off", 403, self.why_off)
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            return self._refuse("no_secret", 401, "needs the run secret: Authorization: Bearer")
        if not hmac.compare_digest(given.strip().lower().encode(), self.token):
            return self._refuse("bad_secret", 403, "not the run secret")
        if m not in learners:
            return self._refuse("no_learner", 404, f"the syncer knows no learner {m} (yet)")
        self._requests.put(ActionRequest(m, action, client))
        with self._lock:
            self.counts[action] += 1
        return 202, {"accepted": action, "learner": m}

    def carry_out(self, send: Callable[..., None], events: Callable[..., None]) -> None:
        """Send every request accepted since the last call to its learner, each recorded as
        an ``operator`` event (the service's thread: the socket is its own)."""
        while True:
            try:
                a = self._requests.get_nowait()
            except queue.Empty:
                return
            told = protocol.Kill if a.action == "kill" else protocol.Leave
            send(a.learner, told(f"an operator at {a.client}"))
            events("operator", action=a.action, learner=a.learner, client=a.client)

    def _refuse(self, why: str, code: int, message: str) -> tuple[int, dict[str, object]]:
        with self._lock:
            self.counts[f"refused_{why}"] += 1
        return code, {"error": message}


def body_of(reply: dict[str, object]) -> bytes:
    return (json.dumps(reply, sort_keys=True) + "\n").encode()
