"""Data-parallel baselines on the simulated clock: one model, global batch = the live
replicas' batches, synchronous steps as long as the slowest replica plus a ring all-reduce of
the full gradient (2(n-1)/n x model bytes on the slowest link).

Under the same chaos plan as the fragment-sync methods:
- ``data_parallel`` (not elastic): a crash stops the job; it restarts from the last
  checkpoint after ``data_parallel.restart_seconds`` (and once the failed replica is back),
  losing the steps since.
- ``elastic_dp``: a crash pauses everyone ``data_parallel.reconfigure_seconds``, then the job
  continues without that replica; its return (or a join) pauses everyone again to scale back up.
A frozen replica stalls everyone (the all-reduce waits for it). Given a
:class:`~ddiloco.runtime.sim.restart.Resume`, the job continues from that checkpoint.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from ddiloco.chaos.plan import ChaosEvent, chaos_record
from ddiloco.checkpoints.sim_state import ResumeState
from ddiloco.data.corpus import BatchStream
from ddiloco.data.info import bits_per_byte
from ddiloco.data.shards import concatenated
from ddiloco.report.summary import summary
from ddiloco.runtime.sim.restart import Resume, rng_state, set_rng
from ddiloco.runtime.sim.run import SimRun
from ddiloco.trainer import Trainer


class DataParallelSim(SimRun):
    """One data-parallel run, elastic or not; with ``checkpoints``, writes the model every
    ``train.checkpoint_every`` tokens it holds (rolled-back steps not counted) and at the end;
    with ``resume``, continues from that checkpoint."""

    def assemble(self) -> None:
        setup = self.setup
        config = setup.config
        self.elastic = setup.method.elastic
        self.eval_batches = setup.eval_batches
        t = config.train
        model = setup.model  # Theta_0; the job trains it
        self.seq_len = setup.seq_len
        shards = concatenated(setup.splits.shards)  # every shard end to end, as a view
        stream = BatchStream(shards, t.batch_size, self.seq_len, config.seed)
        self.trainer = Trainer(model, stream, t, max(1, setup.steps_each))
        self.grad_bytes = sum(p.numel() * 4 for p in model.parameters())
        self.live = set(range(t.learners))
        self.now = 0.0
        self.tokens = 0  # processed, including steps later rolled back
        self.wasted = 0  # tokens of rolled-back steps
        self.stepping_seconds = 0.0  # time the job was stepping (uptime)
        self.kept_replica_seconds = 0.0  # replica-time of steps that were kept (goodput)
        self.bytes = 0
        self.checkpoint = self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        return {
            "trainer": self.trainer.state(),
            "tokens_at": self.tokens - self.wasted,
            "kept_at": self.kept_replica_seconds,
        }

    def _allreduce_seconds(self) -> float:
        n = len(self.live)
        if n <= 1:
            return 0.0
        ring = int(2 * (n - 1) / n * self.grad_bytes)
        self.bytes += ring * n
        slowest = max(self.network.factor_of(m) for m in self.live)
        return self.network.seconds(ring, self.config.network.learner_syncer_gbps) * slowest

    def _pause(self, seconds: float, why: str) -> None:
        self.emit({"kind": "pause", "t": self.now, "seconds": seconds, "why": why})
        self.now += seconds

    def run(self) -> dict[str, Any]:
        t = self.config.train
        dp = self.config.data_parallel
        resume = self.resume
        chaos = self.config.chaos if resume is None else resume.chaos
        events = sorted(chaos, key=lambda e: e.at)
        returns: list[tuple[float, int]] = []  # (time, replica) coming back
        next_eval = t.eval_every
        steps = 0
        if resume is not None:
            self.load_state_dict(resume)
            if resume.finished:  # its summary, as the run that wrote it made it
                return self._summary(resume.eval_loss)
            next_eval, steps = int(resume.values["next_eval"]), int(resume.values["steps"])
        self._eval()
        while self.tokens < t.tokens and not (
            t.max_virtual_seconds and self.now >= t.max_virtual_seconds
        ):
            step = max(self.step_times.sample(m) for m in self.live) + self._allreduce_seconds()
            due = [e for e in events if e.at < self.now + step]
            back = [r for r in returns if r[0] < self.now + step]
            if due or back:  # something happens during this step: it is lost, handle it
                self.now = max(self.now, min([e.at for e in due] + [r[0] for r in back]))
                for e in due:
                    events.remove(e)
                    self._fault(e, returns)
                for r in back:
                    returns.remove(r)
                    self._return(r[1])
                continue
            loss, n = self.trainer.train_step(batches=len(self.live))
            self.now += step
            self.stepping_seconds += step
            self.kept_replica_seconds += step * len(self.live)
            self.tokens += n
            steps += 1
            self.emit(
                {
                    "kind": "step",
                    "t": self.now,
                    "learner": 0,
                    "step": steps,
                    "loss": loss,
                    "batch_tokens": n,
                }
            )
            if steps % dp.checkpoint_every == 0:
                self.checkpoint = self._snapshot()
                self._pause(dp.checkpoint_seconds, "checkpoint")
            evaluated = None
            if self.tokens >= next_eval:
                evaluated = self._eval()
                next_eval = self.tokens + t.eval_every
            kept, writer = self.tokens - self.wasted, self.checkpoints
            if writer is not None and self.tokens < t.tokens and writer.due(kept):
                state = self.state_dict(steps, next_eval, returns)
                writer.write(self.trainer.model, kept, evaluated, state)
        final = self._eval()
        if self.checkpoints is not None:  # the model a user takes home
            state = self.state_dict(steps, next_eval, returns, final=True)
            self.checkpoints.write(self.trainer.model, self.tokens - self.wasted, final, state)
        return self._summary(final)

    def _fault(self, event: ChaosEvent, returns: list[tuple[float, int]]) -> None:
        dp = self.config.data_parallel
        self.emit(chaos_record(event, self.now))
        m = event.learner
        if event.kind == "slow":
            self.step_times.slowdown[m] = event.factor
            if event.duration > 0:
                returns.append((self.now + event.duration, -1 - m))  # speed restored
        elif event.kind == "link_slow":
            self.network.slow(m, event.factor)
        elif event.kind in ("freeze", "link_cut") and m in self.live:
            self._pause(event.duration, event.kind)  # the all-reduce waits for it
        elif event.kind in ("crash", "node_loss", "leave", "preempt") and m in self.live:
            if event.kind != "leave":  # a preempted replica is lost as a crashed one is
                returns.append((self.now + event.duration, m))
            if self.elastic:
                self.live.discard(m)
                self._pause(dp.reconfigure_seconds, "downscale")
            else:
                self._rollback(max(event.duration, 0.0) + dp.restart_seconds)
                if event.kind == "leave":
                    self.live.discard(m)
                else:  # the whole job is back, the failed replica with it
                    self.emit(
                        {
                            "kind": "recovered",
                            "t": self.now,
                            "learner": m,
                            "peer": None,
                            "source": "checkpoint",
                        }
                    )
        elif event.kind == "join" and m not in self.live and self.elastic:
            self._return(m)

    def _return(self, m: int) -> None:
        if m < 0:  # a slowdown ends
            self.step_times.slowdown[-1 - m] = 1.0
            return
        if self.elastic and m not in self.live:
            self.live.add(m)
            self._pause(self.config.data_parallel.reconfigure_seconds, "upscale")
            self.emit(
                {
                    "kind": "recovered",
                    "t": self.now,
                    "learner": m,
                    "peer": None,
                    "source": "upscale",
                }
            )

    def _rollback(self, downtime: float) -> None:
        """Non-elastic failure: everyone stops, restarts from the last checkpoint."""
        lost = self.tokens - self.wasted - self.checkpoint["tokens_at"]
        self.trainer.load_state(copy.deepcopy(self.checkpoint["trainer"]))
        self.wasted += lost
        self.kept_replica_seconds = self.checkpoint["kept_at"]
        self.emit({"kind": "rollback", "t": self.now, "tokens_lost": lost})
        self._pause(downtime, "restart")

    def _eval(self) -> float:
        loss = self.setup.evaluate(self.trainer.model, self.eval_batches)
        self.emit({"kind": "eval", "t": self.now, "tokens": self.tokens, "loss": loss})
        return loss

    def _summary(self, final: float) -> dict[str, Any]:
        allocated = (self.config.train.learners) * self.now
        kept = self.tokens - self.wasted
        return summary(
            method=self.method.name,
            runtime="sim",
            eval_loss=final,
            eval_bpb=bits_per_byte(final, self.config.data.source),
            checkpoint=self.checkpoints.relative() if self.checkpoints else None,
            tokens=self.tokens,
            tokens_merged=float(kept),
            tokens_wasted={"rollback": float(self.wasted)} if self.wasted else {},
            # useful compute / allocated compute: replica-time of kept steps over every
            # replica slot for the whole run
            goodput=self.kept_replica_seconds / max(allocated, 1e-9),
            uptime=self.stepping_seconds / max(self.now, 1e-9),
            seconds=self.now,
            bytes_sent=self.bytes,
            bytes_received=self.bytes,
        )

    # -- resume (``ddiloco train --resume``: runtime/sim/restart.py) ------------------------
    def state_dict(
        self,
        steps: int,
        next_eval: int,
        returns: Sequence[tuple[float, int]],
        final: bool = False,
    ) -> ResumeState:
        """What :meth:`load_state_dict` needs of this run now (reading only): a replica on
        its way back (elastic) counts as live."""
        live = set(self.live) | {m for _, m in returns if m >= 0}
        values = {
            "kind": "data_parallel",
            "final": final,
            "t": self.now,
            "tokens": self.tokens,
            "wasted": self.wasted,
            "steps": steps,
            "next_eval": next_eval,
            "stepping_seconds": self.stepping_seconds,
            "kept_replica_seconds": self.kept_replica_seconds,
            "bytes": self.bytes,
            "live": sorted(live),
            "trainer_steps": self.trainer.steps,
            "position": self.trainer.stream.position,
            "rng": rng_state(self.step_times.rng),
        }
        return ResumeState(values)

    def load_state_dict(self, resume: Resume) -> None:
        """Put this freshly built run at ``resume``'s checkpoint: the model, its step and data
        position, a fresh inner optimizer, the time and the running totals."""
        v = resume.values
        trainer = self.trainer
        trainer.model.load_state_dict(resume.model.state_dict())
        trainer.reset_optimizer()
        trainer.steps = int(v["trainer_steps"])
        trainer.stream.position = int(v["position"])
        self.now = float(v["t"])
        self.tokens = int(v["tokens"])
        self.wasted = int(v["wasted"])
        self.stepping_seconds = float(v["stepping_seconds"])
        self.kept_replica_seconds = float(v["kept_replica_seconds"])
        self.bytes = int(v["bytes"])
        self.live = {int(m) for m in v["live"]}
        set_rng(self.step_times.rng, v["rng"])
        self.checkpoint = self._snapshot()  # a rollback goes back to here at most
