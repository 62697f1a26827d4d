"""SLURM: one CPU job for the syncer, one job per learner, a ``submit.sh`` for all of them.

One job per learner, not one heterogeneous job: a failed node then takes down only its
learner, which SLURM requeues (``--requeue``) while the others train on; a requeued job sees
``SLURM_RESTART_COUNT > 0`` and starts with ``--join`` (it copies a healthy peer, else the
syncer's fragments). A process that crashes is restarted inside its job the same way, up to
``processes.max_restarts`` times; exit 0 (the run is over) and 78 (a fault a restart cannot
fix) end the job.

Learner m serves peer recovery on ``peer_port + m``: two learner jobs may share a node.
The learners find the syncer through ``syncer.address`` in the (shared) output directory,
which the syncer job writes when it starts on whatever node SLURM gave it: nobody has to
know that node in advance, and a requeued syncer on another node rewrites it (a learner that
then gives the old address up, exit 78, reads the new one and rejoins). ``--syncer-host``
pins the syncer to one node instead (``--nodelist``) and writes that name.
"""

from __future__ import annotations

import math

from ddiloco.config import RunConfig
from ddiloco.deploy.common import (
    BASH_CHILD,
    CONFIG_FILE,
    SECRET_FILE,
    DeployOptions,
    Plan,
    Raw,
    learner_args,
    plan,
    syncer_args,
    torchrun,
    words,
)
from ddiloco.errors import require

ADDRESS_FILE = "syncer.address"
ADDRESS_WAIT_SECONDS = 600  # a learner job waits this long for the syncer's address
JOIN_AGAIN = "    join=--join\n"  # a restarted learner copies a peer, never starts at step 0
RDZV_PORT = 29400  # torchrun's rendezvous on a multi-node learner's first node
# the address others dial: $(hostname), or what $DDILOCO_HOST_COMMAND prints on that node
ADVERTISE = '"$(eval "${DDILOCO_HOST_COMMAND:-hostname}")"'


def generate(config: RunConfig, options: DeployOptions) -> dict[str, str]:
    """``syncer.sbatch``, ``learner-<m>.sbatch`` for every learner, ``submit.sh``, README."""
    require(bool(options.home), "--out", options.home, "needs the absolute output directory")
    p = plan(config, options)
    last = p.peer_port + p.learners * p.peer_ports - 1  # learner m: peer_port + m (x ranks)
    require(
        last <= 65535 and not p.peer_port <= p.port <= last,
        "--peer-port",
        p.peer_port,
        f"learners use {p.peer_port}..{last}: must stay under 65536 and off the syncer's {p.port}",
    )
    files = {"syncer.sbatch": syncer_script(config, options, p)}
    for m in range(p.learners):
        files[f"learner-{m}.sbatch"] = learner_script(config, options, p, m)
    files["submit.sh"] = submit_script(options, p)
    files["README.md"] = readme(config, options, p)
    return files


def _header(options: DeployOptions, name: str, log: str, lines: list[str]) -> list[str]:
    out = ["#!/bin/bash", f"#SBATCH --job-name={options.run_id}-{name}"]
    out += [f"#SBATCH --chdir={options.home}", f"#SBATCH --output=logs/{log}-%j.log"]
    out += ["#SBATCH --open-mode=append", "#SBATCH --requeue", *lines]
    for flag in ("account", "time"):
        value = getattr(options, flag)
        if value:
            out.append(f"#SBATCH --{flag}={value}")
    out += [f"#SBATCH {extra}" for extra in options.sbatch_extra]
    return out


def _secret(options: DeployOptions) -> str:
    return options.secret_file or SECRET_FILE


def _restart_loop(
    config: RunConfig, name: str, command: str, before: str = "", after: str = "", again: str = ""
) -> str:
    """Run ``command`` until it exits 0 or 78, restarting a crash with a doubling delay;
    ``before`` each start, ``after`` each exit, ``again`` before a restart (shell lines)."""
    proc = config.processes
    most = proc.max_restarts if proc.restart else 0
    delay = max(1, math.ceil(proc.restart_delay_seconds))
    cap = max(delay, math.ceil(proc.restart_backoff_cap_seconds))
    return f"""\
restarts=0
delay={delay}
while :; do
{before}    run_child {command}
    rc=$?
    [ "$stopping" = 1 ] && exit "$rc"  # cancelled: ddiloco has ended cleanly
{after}    case "$rc" in 0 | 78) exit "$rc" ;; esac  # the run is over, or a fatal fault
    if [ "$restarts" -ge {most} ]; then
        echo "{name}: exit $rc after $restarts restarts: giving up" >&2
        exit "$rc"
    fi
    restarts=$((restarts + 1))
    echo "{name}: exit $rc: restart $restarts of {most} in ${{delay}}s" >&2
    sleep "$delay"
    delay=$((delay * 2 > {cap} ? {cap} : delay * 2))
{again}done
"""


def syncer_script(config: RunConfig, options: DeployOptions, p: Plan) -> str:
    lines = ["#SBATCH --nodes=1", "#SBATCH --ntasks=1"]
    lines.append(f"#SBATCH --cpus-per-task={options.syncer_cpus}")
    partition = options.syncer_partition or options.partition
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if options.syncer_host:
        lines.append(f"#SBATCH --nodelist={options.syncer_host}")
    store = options.store or "store"
    command = words("ddiloco", syncer_args(CONFIG_FILE, options, p, store, _secret(options)))
    host = words(options.syncer_host) if options.syncer_host else ADVERTISE
    body = f"""\
# The CPU syncer of run {options.run_id}, by `ddiloco deploy slurm` (docs/deploy.md).
# It tells the learner jobs where it is ({ADDRESS_FILE}), then serves; a crash restarts it
# here, resuming from its store; a failed node requeues the job.
{options.env_setup}
{BASH_CHILD}
host={host}
printf '%s:%s\\n' "$host" {p.port} > {ADDRESS_FILE}.tmp && mv -f {ADDRESS_FILE}.tmp {ADDRESS_FILE}
{_restart_loop(config, "syncer", command)}"""
    return "\n".join(_header(options, "syncer", "syncer", lines)) + "\n" + body


def learner_script(config: RunConfig, options: DeployOptions, p: Plan, m: int) -> str:
    """Learner ``m``'s job; with several nodes srun runs this same file on each (``--node``)."""
    lines = [f"#SBATCH --nodes={p.nodes}", "#SBATCH --ntasks-per-node=1"]
    cpus = options.cpus_per_learner or max(1, p.ranks_per_node * config.processes.threads)
    lines.append(f"#SBATCH --cpus-per-task={cpus}")
    if options.partition:
        lines.append(f"#SBATCH --partition={options.partition}")
    if p.gpus:
        lines.append(f"#SBATCH --gres=gpu:{p.gpus // p.nodes}")
    common = [
        *["learner", "--syncer", Raw('"$syncer"'), "--id", str(m)],
        *["--state-dir", f"state/learner-{m}", "--peer-host", Raw(ADVERTISE)],
        *learner_args(CONFIG_FILE, options, _secret(options), p.peer_port + m * p.peer_ports),
    ]
    node = ""
    if p.nodes > 1:  # every node runs torchrun; their rendezvous is on the first node
        rdzv = [
            *["--nnodes", str(p.nodes), "--rdzv-backend", "c10d"],
            *["--rdzv-endpoint", Raw(f'"$head:{RDZV_PORT}"')],
            *["--rdzv-id", Raw('"$SLURM_JOB_ID-$attempt"')],
        ]
        node = f"""\
if [ "${{1:-}}" = --node ]; then  # one node of this learner: srun runs this file on each
    syncer=$2 head=$3 attempt=$4
    shift 4
    exec {words(torchrun(p, rdzv), common)} "$@"
fi
"""
        command = words(
            ["srun", f"--nodes={p.nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"],
            ["bash", f"learner-{m}.sbatch", "--node", Raw('"$syncer"'), Raw('"$head"')],
            [Raw('"$restarts"'), Raw("$join")],
        )
    elif p.ranks > 1:
        srun = ["srun", "--ntasks=1", "--kill-on-bad-exit=1"]
        command = words(srun, torchrun(p), common, [Raw("$join")])
    else:
        command = words("ddiloco", common, [Raw("$join")])
    before = f'    syncer="$(cat {ADDRESS_FILE})"\n'
    if p.nodes > 1:
        before += '    head="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"\n'
    after = f"""\
    if [ "$rc" = 78 ] && [ "$(cat {ADDRESS_FILE})" != "$syncer" ]; then
        echo "learner {m}: the syncer moved to $(cat {ADDRESS_FILE}): rejoining" >&2
        join=--join
        continue
    fi
"""
    body = f"""\
# Learner {m} of run {options.run_id}, by `ddiloco deploy slurm` (docs/deploy.md).
{options.env_setup}
{node}{BASH_CHILD}
join=""
if [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ]; then
    join=--join  # requeued (a node failed): copy a healthy peer rather than start at step 0
fi
waited=0
until [ -s {ADDRESS_FILE} ]; do
    if [ "$waited" -ge {ADDRESS_WAIT_SECONDS} ]; then
        echo "learner {m}: no {ADDRESS_FILE} after {ADDRESS_WAIT_SECONDS}s: is the syncer up?" >&2
        exit 78
    fi
    sleep 2
    waited=$((waited + 2))
done
{_restart_loop(config, f"learner {m}", command, before, after, JOIN_AGAIN)}"""
    return "\n".join(_header(options, f"learner-{m}", f"learner-{m}", lines)) + "\n" + body


def submit_script(options: DeployOptions, p: Plan) -> str:
    learners = " ".join(str(m) for m in range(p.learners))
    return f"""\
#!/bin/bash
# Submit run {options.run_id}: the syncer, then every learner once the syncer job has started
# (--dependency=after). Job ids go to jobs.txt (README.md: watch and stop).
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p logs state
rm -f {ADDRESS_FILE}  # a previous run's: the learners wait for this run's syncer
syncer=$(sbatch --parsable syncer.sbatch)
syncer=${{syncer%%;*}}
echo "syncer $syncer" > jobs.txt
for m in {learners}; do
    job=$(sbatch --parsable --dependency=after:"$syncer" "learner-$m.sbatch")
    echo "learner-$m ${{job%%;*}}" >> jobs.txt
done
cat jobs.txt
"""


def readme(config: RunConfig, options: DeployOptions, p: Plan) -> str:
    home, run = options.home, options.run_id
    gpus = f"`--gres=gpu:{p.gpus // p.nodes}` per node" if p.gpus else "no GPUs"
    each = f" x {p.ranks}, rank r of a sharded learner on that + r" if p.sharded else ""
    extra = ""
    if config.chaos:
        extra += "\nThe config's `[[chaos]]` events are played only by `ddiloco train`: not here.\n"
    if config.train.scavenged:
        extra += (
            "\nScavenged slots are not submitted: start one by hand with "
            "`ddiloco learner --id M --join ...` as in learner-0.sbatch.\n"
        )
    return f"""\
# Run `{run}` on SLURM

Written by `ddiloco deploy slurm`; `{home}` must be on a filesystem every node mounts.

- `{CONFIG_FILE}`: the run config every process reads
- `{_secret(options)}`: the run secret (mode 0600, never on a command line): keep it private
- `syncer.sbatch`: the CPU syncer: binds 0.0.0.0:{p.port}, writes `{ADDRESS_FILE}`, keeps its
  state in `{options.store or "store"}`
- `learner-<m>.sbatch`: learner m (of {p.learners}): {p.nodes} node(s), {p.ranks} rank(s),
  {gpus}, peer port {p.peer_port} + m
- `submit.sh`: submits the syncer, then the learners (`--dependency=after`)

Launch, watch, stop:

```bash
bash {home}/submit.sh                      # job ids in {home}/jobs.txt
squeue --name={",".join([f"{run}-syncer", *[f"{run}-learner-{m}" for m in range(p.learners)]])}
tail -f {home}/logs/syncer-*.log            # events: @event {{"kind": ...}} lines
grep '"kind": "summary"' {home}/logs/syncer-*.log   # the run's summary, at the end
scancel --full --signal=TERM $(awk '$1 == "syncer" {{print $2}}' {home}/jobs.txt)  # clean stop
scancel $(awk '{{print $2}}' {home}/jobs.txt)   # kill everything at once
```

A clean stop (SIGTERM to the syncer) evaluates, prints the summary and tells the learners to
stop; their jobs then end by themselves. A learner whose node fails is requeued and starts
with `--join` (`SLURM_RESTART_COUNT` > 0); a crashed process is restarted in its job (up to
`processes.max_restarts`); exit 78 is never restarted. The syncer, restarted or requeued,
resumes from its store. Ports to open between nodes: {p.port} (syncer) and
{p.peer_port}-{p.peer_port + p.learners * p.peer_ports - 1} (learner m's peer recovery on
{p.peer_port} + m{each},
so that learners sharing a node never want the same port). The address others dial is each
node's `$(hostname)`; to use another, export a command that prints it before `submit.sh`, e.g.
`export DDILOCO_HOST_COMMAND="hostname -I | cut -d' ' -f1"` (the jobs inherit it).
{extra}"""
