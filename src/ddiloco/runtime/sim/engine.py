"""Fragment-synchronized training on the simulated clock: M real learners, one syncer.

Decoupled DiLoCo, Streaming DiLoCo and DiLoCo all run here; a method (:mod:`ddiloco.methods`)
only chooses the settings (fragments, quorum, grace, merge rule, whether learners wait for
merged fragments). Every rule comes from the core (the step boundary, ``LearnerSync``,
``SyncerState``, the codec, the ledger); this module only decides *when* things happen: a
step ends after the hardware model's step time, a message arrives after the network model's
transfer time, a fault strikes when the chaos plan says (:mod:`ddiloco.runtime.sim.faults`).
Payloads really are encoded and decoded, so bytes and quantization error are real. Same
config and seed, same run, bit for bit. Given a :class:`~ddiloco.runtime.sim.restart.Resume`,
the run continues from that checkpoint instead (not bit for bit: :mod:`ddiloco.runtime.resume`).
"""

from __future__ import annotations

from typing import Any

import torch

from ddiloco.checkpoints.format import CheckpointError
from ddiloco.checkpoints.sim_state import STATE, ResumeState, pack, unpack
from ddiloco.core import ledger as reasons
from ddiloco.core.boundary import StepBoundary
from ddiloco.core.codec import decode_tensors, encode_tensors
from ddiloco.core.fragment_state import FragmentState
from ddiloco.core.fragments import gather, scatter
from ddiloco.core.learner_state import LearnerSync
from ddiloco.core.ledger import TokenLedger
from ddiloco.core.rounds import AnswerMeta, Verdict
from ddiloco.core.syncer_state import MergeResult, SyncerState
from ddiloco.data.corpus import BatchStream
from ddiloco.report.summary import Uptime
from ddiloco.runtime.sim.accounting import summarize
from ddiloco.runtime.sim.clock import EventQueue
from ddiloco.runtime.sim.faults import Faults
from ddiloco.runtime.sim.node import Node, NodeState
from ddiloco.runtime.sim.restart import RESUMED, Resume, answer_key, rng_state, set_rng
from ddiloco.runtime.sim.run import SimRun
from ddiloco.trainer import Trainer

# How fast the CPU syncer merges (bytes of answers per second) in virtual time.
SYNCER_BYTES_PER_SECOND = 2e9


class FragmentSim(SimRun):
    """Runs one fragment-synchronized experiment on the virtual clock; with ``checkpoints``,
    writes the global model (and its resume state) every ``train.checkpoint_every`` tokens
    and at the end; with ``resume``, continues from that checkpoint."""

    def assemble(self) -> None:
        setup = self.setup
        config = setup.config
        self.sync = setup.method.sync
        self.clock = EventQueue()
        slots = setup.slots
        self.plan = setup.plan
        self.ledger = TokenLedger(self.plan.num_fragments, carry=self.sync.apply == "carry")
        self.syncer = SyncerState(
            self.plan,
            setup.initial,
            self.sync.syncer_config(),
            plain_tensors=setup.plain,
            ledger=self.ledger,
            schedule=setup.outer_schedule(),
        )
        self.seq_len = setup.seq_len
        t = config.train
        self.nodes: list[Node] = []
        for m in range(slots):
            model = setup.replica()  # every replica starts from Theta_0
            shard = setup.splits.shards[m]
            stream = BatchStream(shard, t.batch_size, self.seq_len, config.seed + m)
            trainer = Trainer(model, stream, t, setup.steps_each)
            sync = LearnerSync(
                m, self.plan, trainer.params(), apply=self.sync.apply, blend=self.sync.blend
            )
            present = m < t.learners  # scavenged slots start absent and join later
            state = NodeState.STEPPING if present else NodeState.ABSENT
            self.nodes.append(Node(m, trainer, self.boundary_of(sync), state=state))
            if present:
                self.syncer.join(m)
        self.faults = Faults(self)
        self.tokens = 0
        self.next_eval = 0
        self.finished = False
        self.bytes_up = 0
        self.bytes_down = 0
        self.bytes_peer = 0
        self.wakes: set[float] = set()
        self.uptime = Uptime(self.sync.rounds.quorum)  # virtual time with >= K learners up
        self.idle_seconds = 0.0  # lock-step waiting, summed over learners

    def boundary_of(self, sync: LearnerSync) -> StepBoundary:
        return StepBoundary(
            sync, overlap=self.sync.rounds.overlap, waits_for_merge=self.method.waits_for_merge
        )

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        chaos = self.config.chaos
        if self.resume is not None:
            self.load_state_dict(self.resume)
            if self.resume.finished:  # its summary, as the run that wrote it made it
                return summarize(self, self.resume.eval_loss)
            chaos = self.resume.chaos
        self.evaluate()
        if self.resume is not None:
            self.next_eval = int(self.resume.values["next_eval"])
        for node in self.nodes:
            if node.up:
                self.clock.after(
                    self.step_times.sample(node.id), self.step_done, node.id, node.incarnation
                )
        for event in chaos:
            self.clock.at(event.at, self.faults.strike, event)
        while not self.finished and self.clock.step():
            pass
        self.account_uptime()
        for node in self.nodes:
            if node.waiting_since is not None:
                self.idle_seconds += self.clock.now - node.waiting_since
        self.ledger.close()
        due = self.next_eval
        final = self.evaluate()
        self.next_eval = due  # (its final state: a resume to a raised budget keeps the cadence)
        if self.checkpoints is not None:  # the model a user takes home
            state = self.state_dict(final=True)
            self.checkpoints.write_fragments(self.syncer.fragments, self.tokens, final, state)
        return summarize(self, final)

    # -- learners ---------------------------------------------------------------------------
    def step_done(self, m: int, incarnation: int) -> None:
        node = self.nodes[m]
        if not node.up or node.incarnation != incarnation or self.finished:
            return
        if node.frozen:  # the step finished computing as the process was stopped
            node.step_pending = True
            return
        now = self.clock.now
        loss, tokens = node.trainer.train_step()
        node.sync.stepped(tokens)
        self.ledger.trained(m, tokens)
        self.tokens += tokens
        step = node.sync.step
        self.emit(
            {
                "kind": "step",
                "t": now,
                "learner": m,
                "step": step,
                "loss": loss,
                "batch_tokens": tokens,
            }
        )
        self.send_progress(node)
        self.at_boundary(node)
        evaluated = self.evaluate() if self.tokens >= self.next_eval else None
        limit = self.config.train.max_virtual_seconds
        if self.tokens >= self.config.train.tokens or (limit and now >= limit):
            self.finished = True
            return
        if self.checkpoints is not None and self.checkpoints.due(self.tokens):
            state = self.state_dict()
            self.checkpoints.write_fragments(self.syncer.fragments, self.tokens, evaluated, state)
        self.continue_or_wait(node)

    def send_progress(self, node: Node) -> None:
        step_seconds = self.step_times.sample(node.id)
        node.next_step = step_seconds
        latency = self.config.network.latency_seconds
        self.clock.after(
            latency, self._progress_arrive, node.id, node.incarnation, node.sync.step, step_seconds
        )

    def at_boundary(self, node: Node, step_end: bool = True) -> None:
        """Between two steps: the core's step boundary (answers first, then the merged
        fragments that arrived). ``step_end`` is False when a waiting learner is woken up at
        the same boundary again."""
        params = node.trainer.params()
        for answer in node.boundary.answers(node.asks, params, step_end):
            meta = answer.meta
            payload = encode_tensors(answer.delta, self.sync.codec.answers_spec())
            self.ledger.answered(node.id, meta.fragment, meta.key, meta.c_tokens)
            self.bytes_up += len(payload)
            arrival = self.network.up(node.id, self.clock.now, len(payload))
            self.clock.at(arrival, self._answer_arrive, node.id, node.incarnation, meta, payload)
        node.asks.clear()
        for p in node.boundary.apply(node.inbox, params):
            self.ledger.rebased(node.id, p)
        node.inbox.clear()

    def continue_or_wait(self, node: Node) -> None:
        """Start the next step, unless the step boundary says to wait for a merged fragment."""
        if node.boundary.must_wait():
            node.state = NodeState.WAITING
            node.waiting_since = self.clock.now
            return
        self.clock.after(node.next_step, self.step_done, node.id, node.incarnation)

    def ask_arrive(self, m: int, incarnation: int, p: int, round_id: int) -> None:
        node = self.nodes[m]
        if node.up and node.incarnation == incarnation:
            node.asks[p] = round_id
            if node.state is NodeState.WAITING:  # a waiting learner answers right away
                self.wake(node)

    def broadcast_arrive(
        self, m: int, incarnation: int, p: int, version: int, values: list[torch.Tensor]
    ) -> None:
        node = self.nodes[m]
        if not (node.up and node.incarnation == incarnation):
            return
        held = node.inbox.get(p)
        if held is None or held[0] < version:
            node.inbox[p] = (version, values)
        if node.state is NodeState.WAITING:
            self.wake(node)

    def wake(self, node: Node) -> None:
        """Something arrived for a waiting learner: the boundary again; step if it may."""
        if node.frozen:
            return
        self.at_boundary(node, step_end=False)
        if not node.boundary.must_wait():
            self.idle_seconds += self.clock.now - (node.waiting_since or self.clock.now)
            node.state = NodeState.STEPPING
            node.waiting_since = None
            self.clock.after(node.next_step, self.step_done, node.id, node.incarnation)

    # -- syncer -----------------------------------------------------------------------------
    def _progress_arrive(self, m: int, incarnation: int, step: int, step_seconds: float) -> None:
        node = self.nodes[m]
        if node.incarnation != incarnation or m not in self.syncer.live:
            return
        latency = self.config.network.latency_seconds
        for rnd in self.syncer.on_progress(m, step, self.clock.now, step_seconds):
            for a in sorted(rnd.asked):
                incarnation_a = self.nodes[a].incarnation
                self.clock.after(
                    latency, self.ask_arrive, a, incarnation_a, rnd.fragment, rnd.round_id
                )
        self.poll()

    def _answer_arrive(self, m: int, incarnation: int, meta: AnswerMeta, payload: bytes) -> None:
        if self.nodes[m].incarnation != incarnation:  # the learner died while this was on the wire
            self.ledger.wasted_answer(meta.key, reasons.LOST_IN_FLIGHT)
            return
        verdict = self.syncer.on_answer(meta, decode_tensors(payload), self.clock.now)
        if verdict not in (Verdict.ACCEPTED, Verdict.WAITING):
            self.emit(
                {
                    "kind": "drop",
                    "t": self.clock.now,
                    "learner": m,
                    "fragment": meta.fragment,
                    "verdict": verdict.value,
                }
            )
        self.poll()

    def poll(self) -> None:
        """Merge every round that is ready; wake up again at the next grace deadline."""
        for result in self.syncer.poll(self.clock.now):
            result.book(self.ledger)
            self._broadcast(result)
        deadline = self.syncer.next_deadline()
        if deadline is not None and deadline not in self.wakes:
            self.wakes.add(deadline)
            self.clock.at(deadline, self._wake, deadline)

    def _wake(self, deadline: float) -> None:
        self.wakes.discard(deadline)
        self.poll()

    def _broadcast(self, result: MergeResult) -> None:
        now = self.clock.now
        rnd = result.round
        fragment_bytes = sum(t.numel() * 4 for t in result.tensors)
        merge_seconds = fragment_bytes * max(len(rnd.answers), 1) / SYNCER_BYTES_PER_SECOND
        payload = encode_tensors(result.tensors, self.sync.codec.broadcast_spec())
        values = decode_tensors(payload)  # what every learner receives
        last = now + merge_seconds
        for m in sorted(self.syncer.live):
            arrival = self.network.down(m, now + merge_seconds, len(payload))
            self.bytes_down += len(payload)
            last = max(last, arrival)
            copy = [v.clone() for v in values]
            self.clock.at(
                arrival,
                self.broadcast_arrive,
                m,
                self.nodes[m].incarnation,
                result.fragment,
                result.version,
                copy,
            )
        self.syncer.record_sync_time(last - now)
        self.emit({**result.record(len(payload)), "t": now})

    def send_latest(self, node: Node, p: int) -> None:
        """The syncer sends fragment p's current version to one learner (a newcomer)."""
        payload = encode_tensors(self.syncer.fragments[p], self.sync.codec.broadcast_spec())
        self.bytes_down += len(payload)
        arrival = self.network.down(node.id, self.clock.now, len(payload))
        self.clock.at(
            arrival,
            self.broadcast_arrive,
            node.id,
            node.incarnation,
            p,
            self.syncer.versions[p],
            decode_tensors(payload),
        )

    # -- measurement ------------------------------------------------------------------------
    def evaluate(self) -> float:
        """Eval loss of the syncer's global parameters (what a user would take home)."""
        loss = self.setup.eval_loss(self.syncer.fragments)
        self.emit({"kind": "eval", "t": self.clock.now, "tokens": self.tokens, "loss": loss})
        self.next_eval = self.tokens + self.config.train.eval_every
        return loss

    def account_uptime(self) -> None:
        self.uptime.account(self.clock.now, sum(n.up for n in self.nodes))

    # -- resume (``ddiloco train --resume``: runtime/sim/restart.py) ------------------------
    def state_dict(self, final: bool = False) -> ResumeState:
        """What :meth:`load_state_dict` needs of this run now (reading only): the resume state
        a checkpoint carries (``ddiloco train --resume``)."""
        now = self.clock.now
        tensors: dict[str, torch.Tensor] = {}
        syncer = self.syncer
        # the same fragment state the processes' store keeps (core/fragment_state.py); the
        # values are the checkpoint's model, the answers merged are the ledger's
        states = [syncer.fragment_state(p) for p in range(self.plan.num_fragments)]
        outer = [pack(f"outer.{p}", st.outer, tensors) for p, st in enumerate(states)]
        idle = self.idle_seconds
        if not final:  # (at the end, the run has already counted the waits still going on)
            idle += sum(now - n.waiting_since for n in self.nodes if n.waiting_since is not None)
        up = self.uptime
        live = sum(n.up for n in self.nodes)
        uptime = up.seconds + (now - up.mark if up.mark is not None and live >= up.quorum else 0.0)
        learners = [
            {
                "present": n.state is not NodeState.ABSENT,
                "step": n.sync.step,
                "trainer_steps": n.trainer.steps,
                "position": n.trainer.stream.position,
                "incarnation": n.incarnation,
                "down_seconds": n.down_seconds
                + (now - n.down_since if n.down_since is not None else 0.0),
            }
            for n in self.nodes
        ]
        values = {
            "kind": "fragments",
            "final": final,
            "t": now,
            "tokens": self.tokens,
            "next_eval": self.next_eval,
            "bytes": [self.bytes_up, self.bytes_down, self.bytes_peer],
            "idle_seconds": idle,
            "uptime": [uptime, up.first],
            "counts": dict(syncer.counts),
            "versions": [st.version for st in states],
            "next_round_id": [st.next_round_id for st in states],
            "global_step": syncer.global_step,
            "merged_opened": [st.merged_opened for st in states],  # the outer step's clock
            "merged_base": [[[*k, b] for k, b in sorted(st.merged_base.items())] for st in states],
            "ema": list(syncer.clock_state()[1:]),
            "norm_windows": [st.norm_window for st in states],
            "outer": outer,
            "ledger": self.ledger.to_state(),
            "rng": rng_state(self.step_times.rng),
            "learners": learners,
        }
        return ResumeState(values, tensors)

    def load_state_dict(self, resume: Resume) -> None:
        """Put this freshly built run at ``resume``'s checkpoint: the syncer's fragments (the
        global model), outer optimizers and round counters, the ledger (what was not yet merged
        is wasted as ``resumed``), and every learner present then starting from the global model
        at its own step, learning-rate step and data position, with a fresh inner optimizer."""
        v, plan = resume.values, self.plan
        syncer = self.syncer
        if len(v["learners"]) != len(self.nodes) or len(v["outer"]) != plan.num_fragments:
            raise CheckpointError(
                resume.checkpoint / STATE, "does not fit this run's learners/plan"
            )
        now = self.clock.now = float(v["t"])
        weights = dict(resume.model.named_parameters())
        opened = v.get("merged_opened") or [None] * plan.num_fragments
        bases = v.get("merged_base") or [[] for _ in range(plan.num_fragments)]  # (older: none)
        for p in range(plan.num_fragments):
            state = FragmentState(
                version=int(v["versions"][p]),
                next_round_id=int(v["next_round_id"][p]),
                values=gather(plan, p, weights),
                outer=unpack(f"outer.{p}", v["outer"][p], resume.state.tensors),
                merged_base={(int(a), int(i)): int(b) for a, i, b in bases[p]},
                norm_window=[float(x) for x in v["norm_windows"][p]],
                merged_opened=None if opened[p] is None else int(opened[p]),
            )
            syncer.load_fragment(p, state)
        step_seconds, sync_seconds = v["ema"]
        syncer.load_clock(int(v["global_step"]), step_seconds, sync_seconds)
        syncer.counts = dict(v["counts"])
        self.ledger.load_state(v["ledger"])
        for row in v["ledger"]["answers"]:  # in flight at the checkpoint: lost
            self.ledger.wasted_answer(answer_key(row[0]), RESUMED)
        self.tokens = int(v["tokens"])
        self.bytes_up, self.bytes_down, self.bytes_peer = (int(b) for b in v["bytes"])
        self.idle_seconds = float(v["idle_seconds"])
        self.uptime.seconds, self.uptime.first = v["uptime"]
        self.uptime.mark = now
        set_rng(self.step_times.rng, v["rng"])
        for node, saved in zip(self.nodes, v["learners"], strict=True):
            self.ledger.crashed(node.id, RESUMED)  # its local progress since its base: lost
            node.incarnation = int(saved["incarnation"]) + 1  # a new life: its answers' keys too
            node.down_seconds = float(saved["down_seconds"])
            node.down_since = None
            node.asks.clear()
            node.inbox.clear()
            if not saved["present"]:
                node.state = NodeState.ABSENT
                syncer.leave(node.id, now)
                continue
            trainer = node.trainer
            params = trainer.params()
            for p in range(plan.num_fragments):
                scatter(plan, p, params, syncer.fragments[p])
            trainer.reset_optimizer()
            trainer.steps = int(saved["trainer_steps"])
            trainer.stream.position = int(saved["position"])
            sync = LearnerSync(
                node.id,
                plan,
                params,
                incarnation=node.incarnation,
                apply=self.sync.apply,
                blend=self.sync.blend,
                versions=syncer.versions,
            )
            sync.step = int(saved["step"])
            node.boundary = self.boundary_of(sync)
            node.state = NodeState.STEPPING
            syncer.join(node.id, sync.step)
