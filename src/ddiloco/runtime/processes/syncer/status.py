"""The syncer's status endpoint (``processes.http``): an HTML page, JSON and Prometheus text.

``/`` is a dashboard (:mod:`.status_page`) that reloads ``/status.json`` every two seconds:
progress to the token budget, tokens/s and an ETA, the eval loss against tokens and the
tokens against time (labelled axes), every learner in words (last heard, last merge, its
share of that merge, restarts, peer address), the fragments, the ledger and what the wire
refused. ``/status.json`` is the same data with the raw fields kept for machines;
``/metrics`` is the Prometheus text format (``ddiloco_*`` gauges and counters). The only
requests that change the run are the page's actions (kill / leave a learner), which need the
run secret (:mod:`.actions`); an accepted one is answered 202 with a sentence saying what
happens next (:data:`ACCEPTED`).

The service owns the state and the HTTP thread only reads: once a beat the service builds a
plain snapshot (:func:`snapshot_of`, a pure function of the view) and
:meth:`StatusBoard.publish` swaps it in, with what the board accumulates across snapshots
(the eval curve, the tokens over time and the pace measured from them, each learner's
restarts), so a request never sees the service's dicts half changed. Call order:
:meth:`StatusBoard.merged` for every merge, :meth:`StatusBoard.evaluated` for every
evaluation (from any thread), :meth:`StatusBoard.publish` once a beat,
:meth:`StatusServer.close` at the end.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import Counter, deque
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler
from typing import Any

from ddiloco.core.syncer_state import MergeResult
from ddiloco.errors import ConfigError
from ddiloco.runtime.processes.syncer.actions import ActionGate, body_of
from ddiloco.runtime.processes.syncer.status_http import (
    GuardedHTTPServer,
    Limits,
    Refusals,
    allowed_host,
)
from ddiloco.runtime.processes.syncer.status_page import PAGE
from ddiloco.runtime.processes.syncer.view import SyncerView
from ddiloco.runtime.processes.transport.sockets import parse_address

log = logging.getLogger(__name__)

EVALS_KEPT = 500  # points of the eval curve the page draws
PROGRESS_KEPT = 400  # points of the tokens-over-time curve (thinned 2x when full)
PACE_SECONDS = 30.0  # the tokens/s (and the ETA) are measured over this much of the run
PACE_MIN_SECONDS = 5.0  # ... and not over less (a restarted syncer first hears a burst)
# what an accepted action does, in words (the page shows it; ``{m}``: the learner)
ACCEPTED = {
    "kill": (
        "learner {m} is being killed, as a crash would kill it. If a launcher supervises it "
        "(ddiloco train does), it restarts and copies a healthy peer's state; the other "
        "learners keep training meanwhile."
    ),
    "leave": (
        "learner {m} is asked to leave cleanly: it says goodbye and exits, and is not "
        "restarted; the other learners keep training."
    ),
}


def pace(
    samples: Sequence[tuple[float, int]], budget: int | None, limit: float | None = None
) -> dict[str, float | None]:
    """Tokens a second between the first and the last of ``samples`` ((t, tokens), oldest
    first) and the seconds left to ``budget`` at that rate: None while the samples span under
    :data:`PACE_MIN_SECONDS` (a syncer just restarted hears at once what the learners trained
    while it was down) or show no progress (an ETA would be a guess); 0 once it is reached.
    A time ``limit`` on the samples' clock (``train.max_virtual_seconds``) that comes first
    is the ETA."""
    rate: float | None = None
    if len(samples) >= 2 and samples[-1][0] - samples[0][0] >= PACE_MIN_SECONDS:
        (t0, k0), (t1, k1) = samples[0], samples[-1]
        rate = max(0, k1 - k0) / (t1 - t0)
    eta: float | None = None
    if budget and samples:
        left = max(0, budget - samples[-1][1])
        eta = 0.0 if left == 0 else (left / rate if rate else None)
        if limit and eta is not None:
            eta = min(eta, max(0.0, limit - samples[-1][0]))
    return {
        "tokens_per_second": None if rate is None else round(rate, 1),
        "eta_seconds": None if eta is None else round(eta, 1),
        "window_seconds": PACE_SECONDS,
    }


class StatusBoard:
    """What the endpoint serves: the latest snapshot, and what it accumulates between them.
    Its JSON and metrics are rendered at most once per snapshot, whatever the requests."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._lock = threading.Lock()
        self._snapshot: dict[str, Any] = {"learners": [], "rounds": 0}
        self._rendered: dict[str, bytes] = {}  # "json" / "metrics" of this snapshot
        self._generation = 0
        self.last_merged: dict[int, dict[str, float]] = {}  # learner -> its last merged answer
        self.evals: list[tuple[int, float]] = []
        self.refused = Refusals()  # the endpoint's own refusals (status_http)
        self.progress: list[tuple[float, int]] = []  # (t, tokens), one every _every seconds
        self._every = 1.0
        self._recent: deque[tuple[float, int]] = deque()  # the last PACE_SECONDS of them
        self._lives: dict[int, str] = {}  # learner -> the last life (incarnation) seen
        self.restarts: Counter[int] = Counter()  # learner -> new lives seen since then

    def merged(self, result: MergeResult, now: float) -> None:
        """Each answer's learner: when, the fragment, how stale, its weight and its share of
        the merge (the weights are tokens x tokens per step) and the tokens it carried."""
        total = sum(result.weights.values())
        tokens: Counter[int] = Counter()
        for a in result.round.answers:
            tokens[a.learner] += a.c_tokens
        for a in result.round.answers:
            weight = result.weights.get(a.learner, 0.0)
            self.last_merged[a.learner] = {
                "t": round(now, 3),
                "fragment": a.fragment,
                "staleness": result.version - 1 - a.base_version,
                "weight": weight,
                "share": round(weight / total, 4) if total > 0 else 0.0,
                "tokens": tokens[a.learner],
            }

    def evaluated(self, tokens: int, loss: float) -> None:
        with self._lock:
            self.evals.append((tokens, loss))
            del self.evals[:-EVALS_KEPT]

    def publish(self, snapshot: dict[str, Any]) -> None:
        """Swap ``snapshot`` in, with the board's own: the eval curve, the tokens over time,
        the pace (:func:`pace`), each learner's ``restarts`` and the endpoint's refusals."""
        http = self.refused.snapshot()
        if "t" in snapshot and "tokens" in snapshot:
            self._sample(float(snapshot["t"]), int(snapshot["tokens"]))
        learners = [
            {**row, "restarts": self._restarts(row)} for row in snapshot.get("learners", [])
        ]
        with self._lock:
            self._snapshot = {
                **snapshot,
                "learners": learners,
                "evals": list(self.evals),
                "progress": list(self.progress),
                "pace": pace(self._recent, snapshot.get("budget"), snapshot.get("time_limit")),
                "http": http,
            }
            self._rendered = {}
            self._generation += 1

    def _sample(self, t: float, tokens: int) -> None:
        """One (t, tokens): into the pace's window, and into the curve every ``_every``
        seconds (which doubles when the curve is full, its points thinned 2x)."""
        self._recent.append((t, tokens))
        while len(self._recent) > 2 and self._recent[1][0] <= t - PACE_SECONDS:
            self._recent.popleft()  # (the first one left spans the window)
        if not self.progress or t - self.progress[-1][0] >= self._every:
            self.progress.append((round(t, 3), tokens))
            if len(self.progress) > PROGRESS_KEPT:
                self.progress = self.progress[::2]
                self._every *= 2.0

    def _restarts(self, row: dict[str, Any]) -> int:
        """New lives of a learner seen since this board started: a restart, or a return
        after it left (its incarnation, a random id, changed)."""
        m, life = int(row["learner"]), str(row.get("incarnation") or "")
        if life and self._lives.get(m, life) != life:
            self.restarts[m] += 1
        if life:
            self._lives[m] = life
        return self.restarts[m]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self._snapshot

    def rendered(self, kind: str) -> bytes:
        """The snapshot as ``json`` or ``metrics`` bytes, rendered by the first request after
        a publish (outside the lock: a publish never waits for a render)."""
        with self._lock:
            body, snapshot, generation = self._rendered.get(kind), self._snapshot, self._generation
        if body is not None:
            return body
        if kind == "json":
            body = json.dumps(snapshot, sort_keys=True).encode()
        else:
            body = prometheus(snapshot).encode()
        with self._lock:
            if generation == self._generation:
                self._rendered[kind] = body
        return body


def snapshot_of(view: SyncerView) -> dict[str, Any]:
    """What the page serves, as plain data: the view's raw fields (the board adds what it
    accumulates across views: :meth:`StatusBoard.publish`)."""
    learners = [
        {
            "learner": v.learner,
            "state": v.presence,
            "step": v.step,
            "incarnation": "" if v.incarnation is None else str(v.incarnation),
            "address": v.address,
            "silent_seconds": v.silent_seconds,
            "last_merged": None if v.last_merged is None else dict(v.last_merged),
        }
        for v in view.learners
    ]
    return {
        "run": view.run,
        "t": round(view.t, 3),
        "tokens": view.tokens,
        "budget": view.budget,
        "time_limit": view.time_limit,
        "global_step": view.global_step,
        "rounds": view.answers.get("merged_rounds", 0),
        "uptime": round(view.uptime, 4),
        "learner_uptime": round(view.learner_uptime, 4),
        "versions": list(view.versions),
        "learners": learners,
        "ledger": {
            "tokens_merged": view.ledger["tokens_merged"],
            "tokens_wasted": view.ledger["tokens_wasted"],
            "balanced": bool(view.ledger["balanced"]) and not view.ledger_errors,
        },
        "refused": dict(view.refused),
        "answers": dict(view.answers),
        "actions": dict(view.actions),
    }


def prometheus(snapshot: dict[str, Any]) -> str:
    """The snapshot in Prometheus' text exposition format (version 0.0.4); a counter's name
    ends in ``_total``, in its HELP and TYPE lines too (else a 0.0.4 parser files its samples
    as another, untyped, metric)."""
    lines: list[str] = []

    def metric(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
        sample = f"ddiloco_{name}_total" if kind == "counter" else f"ddiloco_{name}"
        lines.append(f"# HELP {sample} {doc}")
        lines.append(f"# TYPE {sample} {kind}")
        for labels, value in samples:
            lines.append(f"{sample}{labels} {float(value)!r}")

    metric(
        "tokens", "counter", "Tokens trained by every learner.", [("", snapshot.get("tokens", 0))]
    )
    metric("rounds", "counter", "Merged rounds.", [("", snapshot.get("rounds", 0))])
    versions = snapshot.get("versions", [])
    metric(
        "fragment_version",
        "gauge",
        "Version of each global fragment.",
        [(f'{{fragment="{p}"}}', v) for p, v in enumerate(versions)],
    )
    learners = snapshot.get("learners", [])
    metric(
        "learner_up",
        "gauge",
        "1 while the syncer counts the learner live.",
        [(f'{{learner="{r["learner"]}"}}', r["state"] == "up") for r in learners],
    )
    metric(
        "learner_step",
        "gauge",
        "The learner's latest local step.",
        [(f'{{learner="{r["learner"]}"}}', r["step"]) for r in learners if r["step"] is not None],
    )
    restarts = [
        (f'{{learner="{r["learner"]}"}}', r["restarts"]) for r in learners if "restarts" in r
    ]
    metric(
        "learner_restarts",
        "counter",
        "New lives of the learner (since the syncer started).",
        restarts,
    )
    known = {k: v for k, v in snapshot.get("pace", {}).items() if v is not None}
    if "tokens_per_second" in known:
        rate = known["tokens_per_second"]
        metric("tokens_per_second", "gauge", "Tokens trained a second, recently.", [("", rate)])
    if "eta_seconds" in known:
        eta = known["eta_seconds"]
        metric("eta_seconds", "gauge", "Seconds to the token budget at that rate.", [("", eta)])
    ledger = snapshot.get("ledger", {})
    metric("tokens_merged", "counter", "Tokens merged.", [("", ledger.get("tokens_merged", 0))])
    wasted = ledger.get("tokens_wasted", {})
    metric(
        "tokens_wasted",
        "counter",
        "Tokens trained and not merged, by reason.",
        [(f'{{reason="{k}"}}', v) for k, v in sorted(wasted.items())],
    )
    metric(
        "http_refused",
        "counter",
        "Requests and connections the status endpoint refused, by reason.",
        [(f'{{reason="{k}"}}', v) for k, v in sorted(snapshot.get("http", {}).items())],
    )
    evals = snapshot.get("evals", [])
    if evals:
        metric("eval_loss", "gauge", "The global model's latest eval loss.", [("", evals[-1][1])])
    return "\n".join(lines) + "\n"


class StatusServer:
    """The endpoint, on a daemon thread, bound to ``address`` (``HOST:PORT``; port 0: free),
    answering for the hosts of :func:`~.status_http.allowed_host` (``processes.http_hosts``:
    ``gate.hosts``) within ``limits``."""

    def __init__(
        self, address: str, board: StatusBoard, gate: ActionGate, limits: Limits | None = None
    ) -> None:
        host, port = parse_address(address, "processes.http")
        limits = limits or Limits()
        names = {host.lower(), *gate.hosts}  # (a name the endpoint was bound by is its own)
        handler = _handler(board, gate, names, limits)
        try:
            self.httpd = GuardedHTTPServer((host, port), handler, limits, board.refused)
        except OSError as exc:
            raise ConfigError("processes.http", address, f"cannot bind: {exc}") from exc
        bound_host, bound_port = self.httpd.server_address[:2]
        if isinstance(bound_host, bytes):
            bound_host = bound_host.decode()
        self.url = f"http://{bound_host}:{bound_port}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


_PATH = re.compile(r"/[!-~]{0,2047}")  # printable ASCII, no space: what the page's paths are
_LENGTH = re.compile(r"[0-9]{1,4}")  # ASCII digits ("²".isdigit() is true, int("²") raises)
_MALFORMED = (400, 414, 431, 501, 505)  # what the standard library itself answers


def _handler(
    board: StatusBoard, gate: ActionGate, names: set[str], limits: Limits
) -> type[BaseHTTPRequestHandler]:
    page = PAGE.encode()
    refused = board.refused

    class Handler(BaseHTTPRequestHandler):
        timeout = limits.seconds + 5.0  # (each read's; the server's reaper comes first)

        def do_GET(self) -> None:
            if not self._checked():
                return
            path = self.path.split("?", 1)[0]
            if path == "/":
                self._send(200, "text/html; charset=utf-8", page)
            elif path == "/status.json":
                self._send(200, "application/json", board.rendered("json"))
            elif path == "/metrics":
                body = board.rendered("metrics")
                self._send(200, "text/plain; version=0.0.4; charset=utf-8", body)
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found\n")

        def do_POST(self) -> None:
            if not self._checked():
                return
            given = self.headers.get_all("Content-Length") or ["0"]
            if len(given) != 1 or not _LENGTH.fullmatch(given[0].strip()):
                self._refuse("malformed", 400, "bad Content-Length")
                return
            length = int(given[0])
            if length > 4096:  # (an action has no body worth reading)
                self._refuse("malformed", 400, "bad Content-Length")
                return
            self.rfile.read(length)
            learners = {int(r["learner"]) for r in board.snapshot().get("learners", [])}
            client = str(self.client_address[0])
            code, reply = gate.post(self.path, self.headers.get("Authorization"), client, learners)
            if code == 202:  # (in words: what happens next)
                reply["message"] = ACCEPTED[str(reply["accepted"])].format(m=reply["learner"])
            else:
                log.warning(
                    "syncer: refused %s from %s: %s", self.path[:80], client, reply["error"]
                )
            self._send(code, "application/json", body_of(reply))

        def _checked(self) -> bool:
            """A printable path and exactly one Host, one the endpoint answers for (else a
            refusal is sent: 400, or 421 for another site's name: DNS rebinding)."""
            if not _PATH.fullmatch(self.path):
                self._refuse("malformed", 400, "bad path")
                return False
            hosts = self.headers.get_all("Host") or []
            verdict = allowed_host(hosts[0], names) if len(hosts) == 1 else None
            if verdict is None:
                self._refuse("malformed", 400, "needs one well-formed Host header")
            elif not verdict:
                self._refuse("host", 421, "not a host this endpoint answers for")
            return bool(verdict)

        def _refuse(self, why: str, code: int, message: str) -> None:
            refused(why, str(self.client_address[0]), f": {message}")
            self._send(code, "application/json", body_of({"error": message}))

        def _send(self, code: int, kind: str, body: bytes) -> None:
            self.close_connection = True
            self.request_version = "HTTP/1.0"  # (a status line even to "HTTP/0.9" and 9.9)
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def send_error(
            self, code: int, message: str | None = None, explain: str | None = None
        ) -> None:
            if code in _MALFORMED:  # (the request line or headers did not parse)
                refused("malformed", str(self.client_address[0]), f": {code} {message}")
            self.request_version = "HTTP/1.0"
            super().send_error(code, message, explain)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # (the run's terminal is not an access log; refusals are logged above)

    return Handler
