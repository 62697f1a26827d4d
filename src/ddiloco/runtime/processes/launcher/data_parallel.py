"""The data-parallel baseline on real processes: one torchrun DDP job, its checkpoints, and
torchrun's own restart, under the same chaos plan as the fragment methods.

:class:`DataParallelJob` starts ``torchrun --standalone --nproc-per-node W --max-restarts N``
(W = ``train.learners`` x ``processes.ranks``; N = ``processes.max_restarts`` plus one for
every crash, node loss or preemption the plan holds, so planned kills do not use up the
budget for real failures) running :mod:`.data_parallel_worker`, relays its rank 0's events
into the run's metrics, and plays the plan on the ranks of replica m (``learner = m``):
crash, node_loss and preempt = SIGKILL (torchrun notices, stops the other ranks and restarts
the whole group at once from the last checkpoint: the steps since are rollback waste; the
``duration`` is not played, torchrun does not wait),
freeze = SIGSTOP then SIGCONT after ``duration`` (every rank stalls in the all-reduce), slow
= the launcher's SIGSTOP/SIGCONT duty cycle. join, leave and the link faults are recorded
as ``chaos`` with ``skipped`` saying why (one torchrun agent runs a fixed group: it cannot
shrink or grow; gloo's all-reduce does not cross the fault proxy).

A job that keeps failing (torchrun exits non-zero: out of restarts) raises
:class:`~.supervision.LaunchError` naming its log; a rank that refuses to run (a damaged
checkpoint, a device this host lacks: its ``fatal`` event) ends the job at once, without
torchrun's restarts. :meth:`DataParallelJob.request_stop` (a hook's, or the first
SIGINT/SIGTERM through :meth:`~.supervisor.Supervisor.interrupt`) sends SIGUSR1 to rank 0,
which stops every rank at the next step, evaluates and reports; if no report comes within
:data:`STOP_WAIT_SECONDS` the job writes the summary from what it heard
(``summary_source: "dp_job"``).

Call order: construct, then :meth:`~DataParallelJob.run` once (it returns the summary, the
schema of :mod:`ddiloco.report.summary`); :meth:`interrupt` from a signal handler meanwhile.
Files: ``<run>/processes/<method>/`` (config.toml, logs/dp.log, checkpoints/); a job started
on a folder with checkpoints resumes from the newest.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ddiloco.chaos.plan import LINK_KINDS, ChaosEvent, chaos_record
from ddiloco.config import RunConfig, to_toml
from ddiloco.errors import FATAL_EXIT, ConfigError
from ddiloco.methods import method_for
from ddiloco.report.summary import summary as report_summary
from ddiloco.runtime.processes.launcher.data_parallel_worker import STOP_SIGNAL
from ddiloco.runtime.processes.launcher.supervision import Verdict
from ddiloco.runtime.processes.launcher.supervisor import Supervisor
from ddiloco.trainer import pick_device

DP = "dp"  # the torchrun agent's process name (logs/dp.log)
RELAYED = ("step", "eval", "checkpoint", "resumed", "learner_up", "rank_up")
WORDS = ("learner_up", "resumed", "step", "eval", "checkpoint", "dp_done")  # rank 0's: it is up
STOP_WAIT_SECONDS = 30.0  # after a stop, for rank 0's report
ELASTIC = (
    "elastic_dp does not run as processes: torchrun on one host restarts the whole "
    "group on a failure (that is data_parallel); shrinking and growing needs an "
    "elastic rendezvous across agents. Run it with --runtime sim"
)
FIXED_GROUP = "non-elastic data-parallel cannot shrink or grow: one torchrun agent, fixed ranks"
NO_PROXY = "gloo's all-reduce traffic does not cross the fault proxy"
LOST = ("crash", "node_loss", "preempt")  # kinds that kill ranks: notice or not, a rank lost
NO_DURATION = "torchrun restarts the group at once: the duration is not played"


class DataParallelJob(Supervisor):
    """One data-parallel method's run as a torchrun job (see the module docstring)."""

    @staticmethod
    def refuse(config: RunConfig, method: str) -> None:
        kind = method_for(config, method)
        if kind.fragments:
            raise ConfigError("methods", method, "a fragment method: the Launcher runs it")
        if kind.elastic:
            raise ConfigError("methods", method, ELASTIC)
        world = config.train.learners * config.processes.ranks
        device = pick_device(config.train.device)
        if device.type == "cuda" and world > 1 and torch.cuda.device_count() < world:
            why = f"{world} ranks need one GPU each; this host has {torch.cuda.device_count()}"
            raise ConfigError("train.device", config.train.device, why)

    def prepare(self) -> None:
        config = self.config
        self.replicas = config.train.learners
        self.per = config.processes.ranks  # ranks per replica (as a torchrun learner's)
        self.world = self.replicas * self.per
        self.config_path = self.home / "config.toml"
        self.config_path.write_text(to_toml(config), encoding="utf-8")
        # a fresh rendezvous store for every restart: torchrun's shared one keeps the last
        # attempt's keys, and the restarted ranks' gloo then dials dead ranks' ports
        # (pytorch/pytorch#135712; seen here: every restart failed "Connection refused")
        self.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        planned = sum(e.kind in LOST and e.learner < self.replicas for e in config.chaos)
        self.max_restarts = config.processes.max_restarts + planned
        self.rank_pids: dict[int, int] = {}  # rank -> pid, the current attempt's
        self.attempt = -1  # torchrun's restart count of the ranks we heard last
        self.crashed: set[int] = set()  # replicas killed since the last (re)start
        self.result: dict[str, Any] | None = None  # rank 0's dp_done
        self.fatal: dict[str, Any] | None = None
        self.up: dict[str, Any] = {}  # the current attempt's learner_up
        self.first_up: float | None = None  # when the first attempt could train
        # up time (goodput and uptime): an attempt is up from its learner_up to its last word
        # (rank 0's last record), its evaluations and checkpoints included, as a Decoupled
        # learner is up while the syncer evaluates; a restart's start-up is not
        self.up_seconds = 0.0  # the earlier attempts'
        self.attempt_t: float | None = None  # the current attempt's learner_up
        self.last_t = 0.0  # the current attempt's last word
        self.kept_up = 0.0  # up time of the steps the current attempt resumed with
        self.saved_up: dict[int, float] = {}  # checkpoint step -> kept up time at its write
        self.tokens = 0  # every step's tokens, rolled back or not
        self.steps = 0
        self.stepping = 0.0  # seconds stepping, every attempt
        # the model's own line of steps (since Theta_0, through the checkpoints it resumed)
        self.lineage: dict[str, float] = {"step": 0, "tokens": 0, "stepping_seconds": 0.0}
        self.checkpoints = 0
        self.checkpoint_seconds = 0.0
        self.resumed: list[dict[str, Any]] = []
        self.carried: dict[str, float] = {}  # --resume: what the earlier launch had trained
        self.last_eval: dict[str, Any] | None = None

    def torchrun(self, name: str) -> bool:
        return name == DP

    def start(self) -> None:
        torchrun = f"-m torch.distributed.run --standalone --nproc-per-node {self.world}"
        module = "ddiloco.runtime.processes.launcher.data_parallel_worker"
        worker = f"--max-restarts {self.max_restarts} -m {module}"
        paths = ["--config", str(self.config_path), "--out", str(self.home)]
        paths += ["--run-dir", str(self.out)]  # where rank 0 writes the global model
        more = ["--t0", repr(self.t0), "--method", self.method]
        self._spawn(DP, [*torchrun.split(), *worker.split(), *paths, *more])

    # -- the ranks --------------------------------------------------------------------------
    def is_rank(self, pid: int) -> bool:
        """Is ``pid`` a live worker of our torchrun agent (not a recycled pid)?"""
        proc = self.procs.get(DP)
        if proc is None or proc.poll() is not None:
            return False
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return False
        return fields[0] != "Z" and int(fields[1]) == proc.pid

    def send(self, pid: int, sig: int) -> bool:
        """``sig`` to one rank (its process group: torchrun gives each a session)."""
        if not self.is_rank(pid):
            return False
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
            return True
        return False

    def signal_replica(self, m: int, sig: int) -> list[int]:
        """``sig`` to every live rank of replica ``m``; returns the pids it reached."""
        ranks = self.rank_pids.copy()  # one C call: safe against the supervisor's thread
        pids = [p for r, p in sorted(ranks.items()) if r // self.per == m]
        return [p for p in pids if self.send(p, sig)]

    def signal_any(self, m: int, sig: int) -> bool:
        return bool(self.signal_replica(m, sig))

    def thaw_ranks(self, pids: list[int]) -> None:
        for pid in pids:
            self.send(pid, signal.SIGCONT)

    # -- chaos ------------------------------------------------------------------------------
    def play(self, event: ChaosEvent) -> None:
        """Play one chaos event on replica ``event.learner``'s ranks (module docstring)."""
        m = event.learner
        record = chaos_record(event, self.now())
        down = f"replica {m}'s ranks are not running (the group is starting or restarting)"
        if m >= self.replicas:
            record["skipped"] = f"no replica {m}: the job has {self.replicas}"
        elif event.kind in LOST:
            if pids := self.signal_replica(m, signal.SIGKILL):
                record.update(pids=pids, note=NO_DURATION)
                self.crashed.add(m)
            else:
                record["skipped"] = down
        elif event.kind == "freeze":
            if pids := self.signal_replica(m, signal.SIGSTOP):
                record["pids"] = pids
                self.after(event.duration, functools.partial(self.thaw_ranks, pids))
            else:
                record["skipped"] = down
        elif event.kind == "slow" and event.factor > 1.0:
            send = functools.partial(self.signal_any, m)  # whichever ranks hold it now
            threading.Thread(
                target=self.duty_cycle, args=(send, event.factor, event.duration), daemon=True
            ).start()
        elif event.kind in ("join", "leave"):
            record["skipped"] = FIXED_GROUP
        elif event.kind in LINK_KINDS:
            record["skipped"] = NO_PROXY
        elif event.kind != "slow":
            record["skipped"] = "not played by the data-parallel job"
        self.emit(record)

    # -- stopping ---------------------------------------------------------------------------
    def request_stop(self) -> None:
        """End the run now: rank 0 stops every rank at the next step, evaluates, reports.
        Frozen ranks are thawed first (the stop must pass the all-reduce); a rank 0 still
        starting is asked once it is up (its ``rank_up``)."""
        self.begin_stop(STOP_WAIT_SECONDS)
        for pid in self.rank_pids.values():
            self.send(pid, signal.SIGCONT)
        if 0 in self.rank_pids:
            self.send(self.rank_pids[0], STOP_SIGNAL)

    # -- supervision ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run to rank 0's report (or a stop's deadline); return the summary."""
        self.start()
        self.schedule_chaos(self.config.chaos)
        try:
            self.watch(lambda: self.result is not None, self.supervise)  # else our own summary
            deadline = time.monotonic() + 10.0  # the ranks and torchrun end by themselves
            proc = self.procs[DP]
            while self.result is not None and proc.poll() is None and time.monotonic() < deadline:
                self.pump(0.05)
        finally:
            self.shutdown()
        self.drain()
        return self.totals()

    def supervise(self) -> bool:
        """Judge the torchrun agent: True when it ended and the job has what it can get
        (rank 0's report, or a stop's); raise :class:`LaunchError` when it failed."""
        proc = self.procs[DP]
        log = self.logs / f"{DP}.log"
        if self.fatal is not None:  # a restart cannot fix it: do not wait for torchrun's
            self.signal(DP, signal.SIGKILL)
            proc.wait()
            time.sleep(0.2)  # the other ranks' last lines
            why = f"rank {self.fatal['rank']} refused to run: not restarted (it cannot help)"
            verdict = Verdict(DP, FATAL_EXIT, self.attempt + 1, 0.0, True, why)
            self.exited(DP, FATAL_EXIT, verdict)
            raise verdict.error(log)
        code = proc.poll()
        if code is None:
            return False
        self.settle(DP)
        self.drain()
        if self.result is not None or self.stop_requested:
            return True
        if self.fatal is not None:
            return self.supervise()
        why = (
            f"torchrun gave up: the rank group failed again after {self.attempt} of its "
            f"--max-restarts {self.max_restarts}"
            if code
            else "torchrun ended without rank 0's report"
        )
        verdict = Verdict(DP, code, self.attempt + 1, 0.0, True, why)
        self.exited(DP, code, verdict)
        raise verdict.error(log)

    def handle(self, name: str, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        if kind == "learner_up":
            self.on_up(record)  # (first: the attempt before it ended at its last word)
        if kind in WORDS:
            self.last_t = max(self.last_t, float(record["t"]))
        if kind == "rank_up":
            attempt, rank = int(record["attempt"]), int(record["rank"])
            if attempt > self.attempt:  # torchrun (re)started the group: the old pids are gone
                self.attempt, self.rank_pids = attempt, {}
            if attempt == self.attempt:
                self.rank_pids[rank] = int(record["pid"])
                if rank == 0 and self.stop_requested:
                    self.request_stop()
        elif kind == "step":
            self.tokens += int(record["batch_tokens"])
            self.steps += 1
            self.stepping += float(record["secs"])
            self.lineage = {
                "step": int(record["step"]),
                "tokens": int(record["tokens"]),
                "stepping_seconds": self.lineage["stepping_seconds"] + float(record["secs"]),
            }
        elif kind == "eval":  # tokens processed so far, as the simulated DP counts them
            self.last_eval = record
            record = {**record, "tokens": self.tokens, "tokens_kept": record["tokens"]}
        elif kind == "checkpoint":
            self.checkpoints += 1
            self.checkpoint_seconds += float(record["seconds"])
            if self.attempt_t is not None:  # what a rollback to it keeps
                self.saved_up[int(record["step"])] = self.kept_up + self.last_t - self.attempt_t
        elif kind == "resumed":
            self.resumed.append({k: record[k] for k in ("step", "tokens", "attempt")})
            if self.resume and int(record["attempt"]) == 0 and not self.carried:
                # a resumed run: the model's tokens and stepping so far are the earlier
                # launch's work, counted once, not this launch's
                self.carried = {
                    "tokens": int(record["tokens"]),
                    "stepping_seconds": float(record.get("stepping_seconds", 0.0)),
                }
        elif kind == "dp_done":
            self.result = record
        elif kind == "fatal" and self.fatal is None:
            self.fatal = record
        if kind in RELAYED:
            self.emit(record)

    def on_up(self, record: dict[str, Any]) -> None:
        """An attempt trains: after a restart, the steps since its checkpoint are lost."""
        if self.up:  # not the first attempt
            lost = int(self.lineage["tokens"]) - int(record["tokens"])
            self.emit(
                {
                    "kind": "rollback",
                    "t": record["t"],
                    "tokens_lost": lost,
                    "from_step": int(self.lineage["step"]),
                    "to_step": int(record["step"]),
                    "attempt": int(record["attempt"]),
                }
            )
            for m in sorted(self.crashed) or [-1]:  # -1: a failure no chaos event caused
                self.emit(
                    {
                        "kind": "recovered",
                        "t": record["t"],
                        "learner": m,
                        "peer": None,
                        "source": "checkpoint",
                        "step": int(record["step"]),
                    }
                )
        self.crashed.clear()
        self.up = record
        t = float(record["t"])
        if self.first_up is None:
            self.first_up = t
        if self.attempt_t is not None:  # the last attempt was up until its last word
            self.up_seconds += max(0.0, self.last_t - self.attempt_t)
        # (a checkpoint of an earlier launch, --resume: its time is not in this run's span)
        self.kept_up = self.saved_up.get(int(record["step"]), 0.0)
        self.attempt_t = self.last_t = t
        self.lineage = {
            "step": int(record["step"]),
            "tokens": int(record["tokens"]),
            "stepping_seconds": float(record["stepping_seconds"]),
        }

    def totals(self) -> dict[str, Any]:
        """The summary (:func:`ddiloco.report.summary.summary`) from rank 0's report, or from
        what the job heard when none came (a stop)."""
        done = self.result or {}
        wall = float(done.get("t", self.now()))
        # goodput and uptime count from the first attempt's start of training, as the
        # syncer's count from the first hello: the launch is no failure (a restart is)
        start = self.first_up if self.first_up is not None else wall
        span = max(wall - start, 1e-9)
        # the last attempt is up to its report (no report: its last word)
        last_up = 0.0 if self.attempt_t is None else max(0.0, self.last_t - self.attempt_t)
        kept = int(done.get("tokens", self.lineage["tokens"]))  # the model's, since Theta_0
        tokens = self.tokens + int(self.carried.get("tokens", 0))  # the run's, every launch
        last = (self.last_eval or {}).get("loss", math.nan)
        rollback = tokens - kept
        n = self.world
        grad_bytes = int(done.get("grad_bytes", self.up.get("grad_bytes", 0)))
        ring = int(2 * (n - 1) / n * grad_bytes)  # one rank's all-reduce bytes, each way
        moved = self.steps * n * ring
        return report_summary(
            method=self.method,
            runtime="processes",
            eval_loss=float(done.get("eval_loss", last)),
            eval_bpb=done.get("eval_bpb"),
            checkpoint=done.get("checkpoint"),  # rank 0's last checkpoint of the model
            tokens=tokens,
            tokens_merged=float(kept),
            tokens_wasted={"rollback": float(rollback)} if rollback else {},
            # up time of the kept steps (every replica alike) over the whole run's; planned
            # evaluations and checkpoints are up, a restart and the steps it rolls back not
            goodput=min(1.0, (self.kept_up + last_up) / span),
            uptime=min(1.0, (self.up_seconds + last_up) / span),
            seconds=wall,  # wall seconds since the launch on this clock
            bytes_sent=moved,
            bytes_received=moved,
            summary_source="dp_worker" if self.result else "dp_job",
            stopped=self.stop_requested,
            stop_signal=signal.Signals(self.stop_signal).name if self.stop_signal else None,
            restarts={DP: self.attempt} if self.attempt > 0 else {},
            max_restarts=self.max_restarts,
            checkpoints=self.checkpoints,
            checkpoint_seconds=self.checkpoint_seconds,
            resumed=self.resumed,
            startup_seconds=start,
            steps=self.steps,
            stepping_seconds=round(self.stepping, 6),  # of the up time: the rest is pauses
            steps_kept=int(done.get("step", self.lineage["step"])),
            ranks=n,
            device=self.up.get("device"),
        )
