"""``ddiloco deploy slurm`` against a real SLURM: a one-node slurmctld + slurmd on 127.0.0.1
that the tests start (auth/none, every file in a temporary directory, free ports) and stop
by PID. ``sbatch --test-only`` takes every generated script; then the syncer and two
learners of gpt-tiny are submitted with ``submit.sh``, one learner is requeued mid-run (it
must come back with ``--join`` and copy a peer), and the README's clean stop (SIGTERM to the
syncer's job) must end every job with exit 0 and the syncer's summary.

Skipped, saying why, where SLURM is not installed (Debian: ``apt-get install slurm-wlm``),
its auth/none plugin is missing, or the tests do not run as root (slurmd starts the jobs).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bases import SMALL

from ddiloco.cli import main

DAEMONS = ("slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel")
AUTH_NONE = glob.glob("/usr/lib*/*/slurm*/auth_none.so") + glob.glob(
    "/usr/lib*/slurm*/auth_none.so"
)


def _missing() -> str | None:
    absent = [name for name in DAEMONS if shutil.which(name) is None]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)}): apt-get install slurm-wlm"
    if not AUTH_NONE:
        return "SLURM's auth/none plugin (auth_none.so) is not installed"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


def free_ports(n: int) -> list[int]:
    """``n`` consecutive free TCP ports (a learner listens on peer_port + its id)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n > 65535:
            continue
        try:
            held = []
            for port in range(base, base + n):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("0.0.0.0", port))
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
        return list(range(base, base + n))
    raise RuntimeError("no free ports")


def slurm_conf(home: Path, ctld: int, slurmd: int) -> str:
    host = socket.gethostname()
    return f"""\
ClusterName=ddtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={home}/state
SlurmdSpoolDir={home}/spool
SlurmctldPidFile={home}/slurmctld.pid
SlurmdPidFile={home}/slurmd.pid
SlurmctldLogFile={home}/slurmctld.log
SlurmdLogFile={home}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=10
NodeName={host} NodeAddr=127.0.0.1 CPUs=8 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A one-node SLURM cluster; yields the environment its commands need."""
    home = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (home / sub).mkdir()
    ctld_port, slurmd_port = free_ports(2)
    conf = home / "slurm.conf"
    conf.write_text(slurm_conf(home, ctld_port, slurmd_port))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for daemon in ("slurmctld", "slurmd"):
            with open(home / f"{daemon}.out", "wb") as out:
                cmd = [daemon, "-D", "-f", str(conf)]
                procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=out))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True)
            if state.stdout.strip() == b"idle":
                break
            time.sleep(0.5)
        else:
            logs = "".join(p.read_text()[-2000:] for p in home.glob("*.out"))
            pytest.fail(f"the SLURM node never came up idle:\n{logs}")
        yield env
    finally:
        # every job of this cluster killed before its daemons go (else slurmstepd lives on)
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            q = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True)
            if q.returncode != 0 or not q.stdout.strip():
                break
            time.sleep(0.5)
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def deploy(tmp_path: Path, *extra: str, sets: tuple[str, ...] = ()) -> Path:
    config = tmp_path / "run.toml"
    config.write_text('name = "slurmtest"\n')
    out = tmp_path / "job"
    syncer_port, peer_port, _ = free_ports(3)  # (two draws may give one port twice)
    argv = ["deploy", "slurm", "--config", str(config), "--out", str(out)]
    argv += ["--port", str(syncer_port), "--peer-port", str(peer_port), "--syncer-cpus", "1"]
    argv += ["--env-setup", f"export PATH={Path(sys.executable).parent}:$PATH", *extra]
    for item in sets:
        argv += ["--set", item]
    assert main(argv) == 0
    return out


def test_sbatch_accepts_every_generated_script(slurm, tmp_path):
    out = deploy(tmp_path, "--partition", "debug", "--time", "0:10:00", sets=tuple(SMALL))
    scripts = sorted(out.glob("*.sbatch"))
    assert [s.name for s in scripts] == ["learner-0.sbatch", "learner-1.sbatch", "syncer.sbatch"]
    for script in scripts:
        test = subprocess.run(
            ["sbatch", "--test-only", str(script)], env=slurm, capture_output=True, text=True
        )
        assert test.returncode == 0 and "to start at" in test.stderr, (script.name, test.stderr)


def events(log: Path) -> list[dict[str, Any]]:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [json.loads(x[len("@event ") :]) for x in lines if x.startswith("@event {")]


def job_ids(out: Path) -> dict[str, str]:
    return dict(line.split() for line in (out / "jobs.txt").read_text().splitlines())


def squeue(env: dict[str, str], ids: list[str]) -> dict[str, str]:
    q = subprocess.run(
        ["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T"],
        env=env,
        capture_output=True,
        text=True,
    )
    return dict(line.split() for line in q.stdout.splitlines())


def wait_for(what: str, check: Any, out: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(1.0)
    logs = "\n".join(
        f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
        for p in sorted((out / "logs").glob("*.log"))
    )
    pytest.fail(f"{what} within {seconds:.0f}s; logs:\n{logs}")


@pytest.mark.slow
def test_a_submitted_run_trains_and_a_requeued_learner_joins_a_peer(slurm, tmp_path):
    sets = (*SMALL, "train.tokens=3000000", "processes.detect_seconds=5.0")
    out = deploy(tmp_path, sets=sets)
    submit = subprocess.run(
        ["bash", str(out / "submit.sh")], env=slurm, capture_output=True, text=True
    )
    assert submit.returncode == 0, submit.stderr
    ids = job_ids(out)
    log = {name: out / "logs" / f"{name}-{job}.log" for name, job in ids.items()}

    def trained(name: str) -> bool:
        return any(e["kind"] == "step" and e["step"] >= 20 for e in events(log[name]))

    wait_for(
        "both learners training", lambda: trained("learner-0") and trained("learner-1"), out, 240
    )
    requeue = subprocess.run(
        ["scontrol", "requeue", ids["learner-1"]], env=slurm, capture_output=True, text=True
    )
    assert requeue.returncode == 0, requeue.stderr

    def state() -> str | None:
        return squeue(slurm, [ids["learner-1"]]).get(ids["learner-1"])

    wait_for("the requeued job pending", lambda: state() == "PENDING", out, 60)

    def released() -> bool:  # a requeued job waits 120 s before it may start again: not here
        if state() == "RUNNING":
            return True
        update = ["scontrol", "update", f"JobId={ids['learner-1']}", "StartTime=now"]
        print(subprocess.run(update, env=slurm, capture_output=True, text=True).stderr)
        return False

    wait_for("the requeued job running again", released, out, 90)

    def rejoined() -> bool:
        return any(
            e["kind"] == "recovered" and e.get("peer") == 0 for e in events(log["learner-1"])
        )

    wait_for("the requeued learner copying learner 0", rejoined, out, 300)
    # the README's clean stop: SIGTERM to the syncer's job (shell and syncer alike)
    stop = ["scancel", "--full", "--signal=TERM", ids["syncer"]]
    assert subprocess.run(stop, env=slurm, capture_output=True).returncode == 0
    wait_for("every job ending", lambda: not squeue(slurm, list(ids.values())), out, 120)
    (summary,) = [e for e in events(log["syncer"]) if e["kind"] == "summary"]
    assert 0 < summary["tokens"] < 3_000_000  # stopped before its budget
    done = {
        int(e["learner"]): e
        for name in ("learner-0", "learner-1")
        for e in events(log[name])
        if e["kind"] == "learner_done"
    }
    assert set(done) == {0, 1} and all(d["step"] > 0 for d in done.values())
    ctld = (Path(slurm["SLURM_CONF"]).parent / "slurmctld.log").read_text()
    for job in ids.values():  # every job ended by itself, exit 0 (the learners: told to stop)
        assert f"JobId={job} WEXITSTATUS 0" in ctld, job
