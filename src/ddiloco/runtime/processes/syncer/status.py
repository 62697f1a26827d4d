"""The syncer's status endpoint (``processes.http``): an HTML page, JSON and Prometheus text.

``/`` is a page that reloads ``/status.json`` every two seconds and shows every learner
(state, local step, incarnation, last merged answer: when, its staleness and weight, peer
address), the rounds, each fragment's version, the ledger, the eval loss curve and what the
wire refused; ``/status.json`` is the same data; ``/metrics`` is the Prometheus text format
(``ddiloco_*`` gauges and counters). The only requests that change the run are the page's
actions (kill / leave a learner), which need the run secret (:mod:`.actions`).

The service owns the state and the HTTP thread only reads: once a beat the service builds a
plain snapshot (:func:`snapshot_of`) and :meth:`StatusBoard.publish` swaps it in, so a
request never sees the service's dicts half changed. Call order: :meth:`StatusBoard.merged`
for every merge, :meth:`StatusBoard.evaluated` for every evaluation (from any thread),
:meth:`StatusBoard.publish` once a beat, :meth:`StatusServer.close` at the end.
"""

from __future__ import annotations

import json
import logging
import re
import threading
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
from ddiloco.runtime.processes.syncer.view import SyncerView
from ddiloco.runtime.processes.transport.sockets import parse_address

log = logging.getLogger(__name__)

EVALS_KEPT = 500  # points of the eval curve the page draws


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

    def merged(self, result: MergeResult, now: float) -> None:
        for a in result.round.answers:
            self.last_merged[a.learner] = {
                "t": round(now, 3),
                "fragment": a.fragment,
                "staleness": result.version - 1 - a.base_version,
                "weight": result.weights.get(a.learner, 0.0),
            }

    def evaluated(self, tokens: int, loss: float) -> None:
        with self._lock:
            self.evals.append((tokens, loss))
            del self.evals[:-EVALS_KEPT]

    def publish(self, snapshot: dict[str, Any]) -> None:
        http = self.refused.snapshot()
        with self._lock:
            self._snapshot = {**snapshot, "evals": list(self.evals), "http": http}
            self._rendered = {}
            self._generation += 1

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
    """What the page serves: the view as plain data."""
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
        "global_step": view.global_step,
        "rounds": view.answers.get("merged_rounds", 0),
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
    """The snapshot in Prometheus' text exposition format (version 0.0.4); counters' samples
    end in ``_total``."""
    lines: list[str] = []

    def metric(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP ddiloco_{name} {doc}")
        lines.append(f"# TYPE ddiloco_{name} {kind}")
        sample = f"ddiloco_{name}_total" if kind == "counter" else f"ddiloco_{name}"
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
            if code != 202:
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


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>ddiloco syncer</title>
<style>
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}
td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}
th{background:#f3f3f3}.up{color:#080}.down{color:#c00;font-weight:bold}.left{color:#888}
#curve{border:1px solid #ccc}
</style></head><body>
<h1>ddiloco syncer <span id="run"></span></h1>
<p id="head">waiting for the first status...</p>
<h2>Learners</h2>
<p id="act">run secret (hex) for kill / leave:
<input id="secret" type="password" size="40" autocomplete="off"> <span id="said"></span></p>
<table id="learners"><thead><tr><th>learner</th><th>state</th><th>step</th>
<th>silent (s)</th><th>last merged (t)</th><th>staleness</th><th>weight</th>
<th>incarnation</th><th>peer address</th><th></th></tr></thead><tbody></tbody></table>
<h2>Fragments</h2><p id="versions"></p>
<h2>Ledger</h2><p id="ledger"></p>
<h2>Eval loss</h2><canvas id="curve" width="600" height="200"></canvas>
<h2>Refused by the wire</h2><p id="refused"></p>
<script>
function cell(v){const td=document.createElement('td');
 td.textContent=(v===null||v===undefined)?'':v;return td}
async function act(m,what){const said=document.getElementById('said');
 try{const r=await fetch('learners/'+m+'/'+what,{method:'POST',headers:{'Authorization':
  'Bearer '+document.getElementById('secret').value.trim()}});const j=await r.json();
  said.textContent=r.status+': '+(j.error||(j.accepted+' learner '+j.learner))}
 catch(e){said.textContent='no answer: '+e}}
function buttons(m,on){const td=document.createElement('td');if(!on)return td;
 for(const what of ['kill','leave']){const b=document.createElement('button');
  b.textContent=what;b.className=what;b.onclick=()=>act(m,what);td.appendChild(b)}return td}
function draw(evals){const c=document.getElementById('curve'),g=c.getContext('2d');
 g.clearRect(0,0,c.width,c.height);if(evals.length<2)return;
 const xs=evals.map(e=>e[0]),ys=evals.map(e=>e[1]),x0=Math.min(...xs),x1=Math.max(...xs),
 y0=Math.min(...ys),y1=Math.max(...ys);g.beginPath();
 evals.forEach((e,i)=>{const x=10+(c.width-20)*(e[0]-x0)/Math.max(1,x1-x0),
 y=c.height-10-(c.height-20)*(e[1]-y0)/Math.max(1e-9,y1-y0);i?g.lineTo(x,y):g.moveTo(x,y)});
 g.stroke();g.fillText(y1.toFixed(3),2,10);g.fillText(y0.toFixed(3),2,c.height-2)}
function n(v){return Math.round(v).toLocaleString('en-US')}
function pct(a,b){return b>0?(100*a/b).toFixed(1)+'%':'-'}
function counts(o){const e=Object.entries(o||{});
 return e.length?e.map(([k,v])=>k.replace(/_/g,' ')+' '+n(v)).join(', '):'none'}
async function load(){try{const s=await (await fetch('status.json',{cache:'no-store'})).json();
 document.getElementById('run').textContent=s.run||'';
 document.getElementById('head').textContent='t = '+s.t.toFixed(1)+' s, tokens '+n(s.tokens)+
  ' of '+n(s.budget)+' ('+pct(s.tokens,s.budget)+'), global step '+s.global_step+', rounds '+
  s.rounds;
 const body=document.querySelector('#learners tbody');body.innerHTML='';
 for(const l of s.learners){const tr=document.createElement('tr');tr.className='learner '+l.state;
  const lm=l.last_merged||{};[l.learner,l.state,l.step,l.silent_seconds,lm.t,lm.staleness,
  lm.weight,l.incarnation,l.address].forEach(v=>tr.appendChild(cell(v)));
  tr.appendChild(buttons(l.learner,(s.actions||{}).enabled));body.appendChild(tr)}
 document.getElementById('act').hidden=!(s.actions||{}).enabled;
 document.getElementById('versions').textContent='versions: '+s.versions.join(', ');
 const led=s.ledger||{},el=document.getElementById('ledger');
 el.textContent='merged '+n(led.tokens_merged)+' tokens ('+pct(led.tokens_merged,s.tokens)+
  ' of those trained); wasted: '+counts(led.tokens_wasted)+'; '+
  (led.balanced?'balanced':'NOT BALANCED');el.className=led.balanced?'':'down';
 document.getElementById('refused').textContent=counts(s.refused);draw(s.evals||[])}
 catch(e){document.getElementById('head').textContent='syncer unreachable: '+e}}
load();setInterval(load,2000);
</script></body></html>
"""
