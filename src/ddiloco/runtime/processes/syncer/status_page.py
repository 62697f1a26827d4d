"""The status endpoint's HTML page (``/``): a training dashboard drawn from ``status.json``.

Kept apart from :mod:`.status` (the data and the server) so each stays readable. The page
reads only ``status.json`` (reloaded every two seconds) and says everything in words and
units a user reads: tokens of the budget, tokens/s and the ETA, the eval loss against tokens
and the tokens against time (axes labelled, with units), each learner's last contact and last
merge as "how long ago", its share of that merge, its restarts. The raw fields (weights,
incarnations, the service clock's t) stay in ``status.json`` for machines. The learners do not
send their training loss to the syncer (their progress reports carry steps and tokens), so the
page says where it is instead of showing it. Everything from the JSON reaches the page as text
(``textContent``), never as markup.
"""

from __future__ import annotations

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ddiloco run</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;max-width:1120px}
table{border-collapse:collapse;margin:.5em 0 1.5em}
td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}td{white-space:nowrap}
th{background:#f3f3f3;font-weight:600}th[title]{cursor:help;text-decoration:underline dotted}
.up{color:#080}.down{color:#c00;font-weight:bold}.left{color:#888}
#bar{height:10px;background:#eee;border-radius:5px;overflow:hidden;max-width:640px}
#bar div{height:100%;background:#4a7;width:0}
.cards{display:flex;flex-wrap:wrap;gap:.6em;margin:1em 0}
.card{border:1px solid #ddd;border-radius:6px;padding:.4em .8em;min-width:9.5em}
.card b{display:block;font-size:1.35em}.card span{color:#666;font-size:.85em}
canvas{border:1px solid #ddd;margin:0 1em 1em 0;max-width:100%}
.note{color:#666;font-size:.9em}
</style></head><body>
<h1>ddiloco run <span id="run"></span></h1>
<p id="head">waiting for the syncer's first status...</p>
<div id="bar"><div></div></div>
<div class="cards" id="cards"></div>
<p class="note">Training loss: the learners do not send it to the syncer, so this page cannot
show it; it is in the run's <code>metrics.jsonl</code> (step records) under
<code>ddiloco train</code>, and in each learner's own output. The eval loss below is the
syncer's evaluation of the global model.</p>
<h2>Progress</h2>
<canvas id="loss" width="530" height="270"></canvas><canvas id="tokens" width="530"
height="270"></canvas>
<h2>Learners</h2>
<p id="act">Run secret (hex; <code>RUN/processes/run.secret</code> under ddiloco train) for
the kill / leave buttons: <input id="secret" type="password" size="40" autocomplete="off">
<span id="said" role="status"></span></p>
<table id="learners"><thead><tr><th>learner</th><th>state</th><th>local step</th>
<th title="since the syncer last heard from it (any message, heartbeats included)">last heard</th>
<th title="since an answer of it was last merged into a global fragment">last merge</th>
<th>fragment</th>
<th title="merges of that fragment between its base and this one (0: up to date)">staleness</th>
<th title="its weight in that merge, of every answer's (weights are tokens x tokens per step)"
>share of merge</th>
<th title="tokens of training that answer carried">tokens merged</th>
<th title="new processes of this learner since the syncer started (a restart, a return)"
>restarts</th><th title="where it serves its state to a recovering peer">peer address</th>
<th></th></tr></thead><tbody></tbody></table>
<h2>Fragments</h2><p id="versions"></p>
<h2>Tokens</h2><p id="ledger"></p>
<h2>Refused by the wire</h2><p id="refused"></p>
<p class="note">Machine-readable: <a href="status.json">status.json</a> (the raw fields),
<a href="metrics">metrics</a> (Prometheus).</p>
<script>
const $=id=>document.getElementById(id);
const WASTE={stale:'too stale to merge',base_already_merged:'would re-apply merged progress',
 invalid:'refused: impossible round or base',overwritten:'replaced by a merge before it was sent',
 crash:'not yet sent when a learner died',left:'not yet sent when a learner left',
 lost_in_flight:'sent but never arrived',unsynced_at_end:'still in a learner at the end',
 in_flight_at_end:'sent, not merged, at the end',outlier:'refused: update norm out of bounds'};
function n(v){return v==null?'-':Math.round(v).toLocaleString('en-US')}
function si(v){const a=Math.abs(v),f=(x,d)=>(+x.toFixed(d)).toString();
 return a>=1e9?f(v/1e9,a>=1e10?0:1)+'G':a>=1e6?f(v/1e6,a>=1e7?0:1)+'M':
  a>=1e3?f(v/1e3,a>=1e4?0:1)+'K':f(v,a<10?1:0)}
function pct(a,b){return b>0?(100*a/b).toFixed(1)+'%':'-'}
function dur(s){if(s==null||!isFinite(s))return '-';s=Math.round(s);if(s<60)return s+' s';
 if(s<3600)return Math.floor(s/60)+' min '+s%60+' s';
 return Math.floor(s/3600)+' h '+Math.floor(s%3600/60)+' min'}
function ago(dt){return dt==null?'never':dt<1?'just now':dur(dt)+' ago'}
function counts(o,words){const e=Object.entries(o||{}).filter(([k,v])=>v);
 return e.length?e.map(([k,v])=>n(v)+' '+((words||{})[k]||k.replace(/_/g,' '))).join('; '):
  'none'}
function fixed(v,step){return v.toFixed(Math.max(0,Math.min(4,-Math.floor(Math.log10(step)))))}
function cell(v,title){const td=document.createElement('td');
 td.textContent=(v===null||v===undefined)?'':v;if(title)td.title=title;return td}
function card(value,label){const d=document.createElement('div'),b=document.createElement('b'),
 s=document.createElement('span');d.className='card';b.textContent=value;s.textContent=label;
 d.append(b,s);return d}
async function act(m,what){const said=$('said');said.textContent='';
 try{const r=await fetch('learners/'+m+'/'+what,{method:'POST',headers:{'Authorization':
  'Bearer '+$('secret').value.trim()}});const j=await r.json();
  said.textContent=r.ok?(j.message||(what+' of learner '+m+' accepted')):
   'not done: '+(j.error||r.statusText)+' (HTTP '+r.status+')'}
 catch(e){said.textContent='no answer from the syncer: '+e}}
function buttons(m,on){const td=document.createElement('td');if(!on)return td;
 for(const what of ['kill','leave']){const b=document.createElement('button');
  b.textContent=what;b.className=what;b.title=what==='kill'?
   'crash it on purpose (it is restarted and copies a peer)':'make it leave cleanly (no restart)';
  b.onclick=()=>act(m,what);td.appendChild(b)}return td}
function ticks(lo,hi,k){const raw=(hi-lo)/k,p=Math.pow(10,Math.floor(Math.log10(raw))),
 m=raw/p,step=(m<1.5?1:m<3.5?2:m<7.5?5:10)*p,out=[];
 for(let i=Math.ceil(lo/step);i*step<=hi+step*1e-9;i++)out.push([i*step,step]);return out}
function chart(id,pts,o){const c=$(id),g=c.getContext('2d'),W=c.width,H=c.height,
 L=62,R=14,T=26,B=44;g.clearRect(0,0,W,H);g.font='12px system-ui,sans-serif';
 g.fillStyle='#222';g.textAlign='center';g.fillText(o.title,W/2,15);
 g.fillText(o.x,L+(W-L-R)/2,H-6);g.save();g.translate(14,T+(H-T-B)/2);
 g.rotate(-Math.PI/2);g.fillText(o.y,0,0);g.restore();
 if(pts.length<1){g.fillStyle='#888';g.fillText(o.empty,W/2,H/2);return}
 const all=pts.concat(o.more||[]),xs=all.map(p=>p[0]),ys=all.map(p=>p[1]);
 let x0=o.x0!=null?o.x0:Math.min(...xs),x1=Math.max(...xs),
  y0=o.y0!=null?o.y0:Math.min(...ys),y1=Math.max(...ys);
 if(x1<=x0)x1=x0+1;if(y1<=y0)y1=y0+Math.max(Math.abs(y0)*.05,1e-3);
 const pad=(y1-y0)*.06;if(o.y0==null)y0-=pad;y1+=pad;
 const X=v=>L+(W-L-R)*(v-x0)/(x1-x0),Y=v=>H-B-(H-T-B)*(v-y0)/(y1-y0);
 g.strokeStyle='#e3e3e3';g.fillStyle='#444';
 for(const [v,st] of ticks(x0,x1,5)){const x=X(v);g.beginPath();g.moveTo(x,T);
  g.lineTo(x,H-B);g.stroke();g.textAlign='center';g.fillText(o.fx(v,st),x,H-B+15)}
 for(const [v,st] of ticks(y0,y1,4)){const y=Y(v);g.beginPath();g.moveTo(L,y);
  g.lineTo(W-R,y);g.stroke();g.textAlign='right';g.fillText(o.fy(v,st),L-5,y+4)}
 g.strokeStyle='#999';g.strokeRect(L,T,W-L-R,H-T-B);
 if(o.ref!=null){g.setLineDash([5,4]);g.strokeStyle='#c60';g.beginPath();
  g.moveTo(L,Y(o.ref));g.lineTo(W-R,Y(o.ref));g.stroke();g.fillStyle='#c60';
  g.textAlign='left';g.fillText(o.refLabel,L+5,Y(o.ref)-5)}
 if(o.more){g.setLineDash([2,4]);g.strokeStyle='#26a';g.beginPath();
  o.more.forEach((p,i)=>i?g.lineTo(X(p[0]),Y(p[1])):g.moveTo(X(p[0]),Y(p[1])));g.stroke()}
 g.setLineDash([]);g.strokeStyle='#26a';g.lineWidth=1.6;g.beginPath();
 pts.forEach((p,i)=>i?g.lineTo(X(p[0]),Y(p[1])):g.moveTo(X(p[0]),Y(p[1])));g.stroke();
 g.lineWidth=1;if(o.dots){g.fillStyle='#26a';for(const p of pts){g.beginPath();
  g.arc(X(p[0]),Y(p[1]),2.5,0,7);g.fill()}}}
function render(s){const pace=s.pace||{},rate=pace.tokens_per_second,eta=pace.eta_seconds,
 evals=s.evals||[],last=evals.length?evals[evals.length-1]:null,done=s.tokens>=s.budget;
 $('run').textContent=s.run||'';
 $('head').textContent=done?'Token budget reached ('+n(s.budget)+' tokens): the last '+
  'answers are merging, then the syncer evaluates the global model and stops the run.':
  'Training: '+n(s.tokens)+' of '+n(s.budget)+' tokens ('+pct(s.tokens,s.budget)+') after '+
  dur(s.t)+(rate?', '+si(rate)+' tokens/s':'')+(eta!=null?', about '+dur(eta)+' to go.':'.');
 $('head').className='';
 $('bar').firstChild.style.width=Math.min(100,s.budget?100*s.tokens/s.budget:0)+'%';
 const up=s.learners.filter(l=>l.state==='up').length,cards=[
  card(si(s.tokens),'tokens trained of '+si(s.budget)+' ('+pct(s.tokens,s.budget)+')'),
  card(rate!=null?si(rate):'-','tokens/s (last '+(pace.window_seconds||30)+' s)'),
  card(done?'done':dur(eta),'ETA to the end of the run (token budget or time limit)'),
  card(dur(s.t),'since the launch'),
  card(last?last[1].toFixed(3):'-',last?'eval loss at '+si(last[0])+' tokens':'eval loss'),
  card(up+' of '+s.learners.length,'learners up'),
  card(n(s.rounds),'merged rounds (global step '+n(s.global_step)+')'),
  card(s.uptime!=null?pct(s.uptime,1):'-','of the time a quorum was up')];
 $('cards').replaceChildren(...cards);
 const body=document.querySelector('#learners tbody'),on=(s.actions||{}).enabled;
 body.replaceChildren();
 for(const l of s.learners){const tr=document.createElement('tr'),lm=l.last_merged||{};
  tr.className='learner '+l.state;const merged=lm.t!=null;
  [cell(l.learner),cell(l.state),cell(l.step==null?'-':n(l.step)),
   cell(l.silent_seconds==null?'never':ago(l.silent_seconds)),
   cell(merged?ago(Math.max(0,s.t-lm.t)):'never'),cell(merged?lm.fragment:''),
   cell(merged?lm.staleness:''),cell(merged&&lm.share!=null?pct(lm.share,1):''),
   cell(merged&&lm.tokens!=null?n(lm.tokens):''),
   cell(l.restarts||0,l.incarnation?'its process now: incarnation '+l.incarnation:''),
   cell(l.address||'')
  ].forEach(td=>tr.appendChild(td));
  tr.appendChild(buttons(l.learner,on));body.appendChild(tr)}
 $('act').hidden=!on;
 $('versions').textContent='Merges applied to each global fragment: '+
  s.versions.map((v,p)=>'fragment '+p+': '+n(v)).join(', ');
 const led=s.ledger||{},el=$('ledger');
 el.textContent='Merged into the global model: '+n(led.tokens_merged)+' tokens ('+
  pct(led.tokens_merged,s.tokens)+' of those trained). Not merged: '+
  counts(led.tokens_wasted,WASTE)+'. '+(led.balanced?'Every token is accounted for.':
  'The ledger does NOT balance: see the summary.');el.className=led.balanced?'':'down';
 $('refused').textContent=counts(s.refused);
 chart('loss',evals,{title:'Eval loss of the global model',dots:true,
  x:'tokens trained (all learners)',y:'eval loss (nats/token)',empty:'no evaluation yet',
  fx:v=>si(v),fy:fixed});
 const [u,unit]=s.t>7200?[3600,'h']:s.t>900?[60,'min']:[1,'s'],
  prog=(s.progress||[]).concat([[s.t,s.tokens]]).map(p=>[p[0]/u,p[1]]),now=[s.t/u,s.tokens];
 chart('tokens',prog,{title:'Tokens trained over time (dotted: at the current pace)',
  x:'time since the launch ('+unit+')',y:'tokens trained',empty:'no progress yet',
  fx:fixed,fy:v=>si(v),y0:0,ref:s.budget,refLabel:'token budget '+si(s.budget),
  more:eta&&!done&&isFinite(eta)?[now,[(s.t+eta)/u,s.budget]]:null})}
async function load(){let s;
 try{s=await (await fetch('status.json',{cache:'no-store'})).json()}
 catch(e){$('head').textContent='The syncer does not answer ('+e+'): the run may have '+
  'ended, or its syncer is restarting (the launcher restarts it on the same address).';
  $('head').className='down';return}
 render(s)}
load();setInterval(load,2000);
</script></body></html>
"""
