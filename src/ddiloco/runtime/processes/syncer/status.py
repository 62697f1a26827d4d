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
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from ddiloco.core.syncer_state import MergeResult
from ddiloco.errors import ConfigError
from ddiloco.runtime.processes.syncer.actions import ActionGate, body_of
from ddiloco.runtime.processes.transport.sockets import parse_address

if TYPE_CHECKING:
    from ddiloco.runtime.processes.syncer.service import SyncerService

log = logging.getLogger(__name__)

EVALS_KEPT = 500  # points of the eval curve the page draws


class StatusBoard:
    """What the endpoint serves: the latest snapshot, and what it accumulates between them."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._lock = threading.Lock()
        self._snapshot: dict[str, Any] = {"learners": [], "rounds": 0}
        self.last_merged: dict[int, dict[str, float]] = {}  # learner -> its last merged answer
        self.evals: list[tuple[int, float]] = []

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
        with self._lock:
            self._snapshot = {**snapshot, "evals": list(self.evals)}

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self._snapshot


def snapshot_of(svc: SyncerService, now: float) -> dict[str, Any]:
    """The service's state as plain data (call it on the service's thread)."""
    policy, attendance = svc.syncer.policy, svc.attendance
    ledger = svc.ledger.summary()
    learners = []
    for m in sorted(set(svc.incarnations) | set(attendance.down_since)):
        live = m in policy.progress
        state = "up" if live else ("down" if m in attendance.down_since else "left")
        heard = attendance.last_heard.get(m)
        learners.append(
            {
                "learner": m,
                "state": state,
                "step": policy.progress.get(m),
                "incarnation": str(svc.incarnations.get(m, "")),
                "address": svc.addresses.get(m, ""),
                "silent_seconds": None if heard is None else round(now - heard, 3),
                "last_merged": svc.status.last_merged.get(m),
            }
        )
    return {
        "run": svc.status.run_id,
        "t": round(now, 3),
        "tokens": svc.tokens,
        "budget": svc.config.train.tokens,
        "global_step": policy.global_step,
        "rounds": svc.syncer.counts.get("merged_rounds", 0),
        "versions": list(svc.syncer.versions),
        "learners": learners,
        "ledger": {
            "tokens_merged": ledger["tokens_merged"],
            "tokens_wasted": ledger["tokens_wasted"],
            "balanced": bool(ledger["balanced"]) and not svc.ledger.errors,
        },
        "refused": dict(sorted(svc.conn.wire.refused.items())),
        "answers": dict(sorted(svc.syncer.counts.items())),
        "actions": {"enabled": svc.actions.enabled, **svc.actions.counts},
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
    evals = snapshot.get("evals", [])
    if evals:
        metric("eval_loss", "gauge", "The global model's latest eval loss.", [("", evals[-1][1])])
    return "\n".join(lines) + "\n"


class StatusServer:
    """The endpoint, on a daemon thread, bound to ``address`` (``HOST:PORT``; port 0: free)."""

    def __init__(self, address: str, board: StatusBoard, gate: ActionGate) -> None:
        host, port = parse_address(address, "processes.http")
        handler = _handler(board, gate)
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise ConfigError("processes.http", address, f"cannot bind: {exc}") from exc
        self.httpd.daemon_threads = True
        bound_host, bound_port = self.httpd.server_address[:2]
        if isinstance(bound_host, bytes):
            bound_host = bound_host.decode()
        self.url = f"http://{bound_host}:{bound_port}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler(board: StatusBoard, gate: ActionGate) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/":
                self._send(200, "text/html; charset=utf-8", PAGE.encode())
            elif path == "/status.json":
                body = json.dumps(board.snapshot(), sort_keys=True).encode()
                self._send(200, "application/json", body)
            elif path == "/metrics":
                body = prometheus(board.snapshot()).encode()
                self._send(200, "text/plain; version=0.0.4; charset=utf-8", body)
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found\n")

        def do_POST(self) -> None:
            given = self.headers.get("Content-Length") or "0"
            length = int(given) if given.isdigit() else -1
            if not 0 <= length <= 4096:  # (an action has no body worth reading)
                self._send(400, "application/json", body_of({"error": "bad Content-Length"}))
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

        def _send(self, code: int, kind: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # (the run's terminal is not an access log)

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
