"""Fragment-synchronized training on the simulated clock: M real learners, one syncer.

Decoupled DiLoCo, Streaming DiLoCo and DiLoCo all run here; a strategy (``ddiloco.strategies``)
only chooses the settings (fragments, quorum, grace, merge rule, whether learners wait for
merged fragments). Every rule comes from the core (``LearnerSync``, ``SyncerState``, the codec,
the ledger); this module only decides *when* things happen: a step ends after the hardware
model's step time, a message arrives after the network model's transfer time, a fault strikes
when the chaos plan says (:mod:`ddiloco.runtime.sim.faults`). Payloads really are encoded and
decoded, so bytes and quantization error are real. Same config and seed, same run, bit for bit.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ddiloco.config import RunConfig
from ddiloco.core import ledger as reasons
from ddiloco.core.codec import decode_tensors, encode_tensors
from ddiloco.core.learner_state import LearnerSync
from ddiloco.core.ledger import TokenLedger
from ddiloco.core.plans import FragmentPlan, scatter
from ddiloco.core.rounds import UNSOLICITED, AnswerMeta, Verdict
from ddiloco.core.syncer_state import MergeResult, SyncerState
from ddiloco.data.corpus import BatchStream, TokenSplits
from ddiloco.models.gpt import embedding_names
from ddiloco.models.registry import build_model
from ddiloco.runtime.sim.accounting import summarize
from ddiloco.runtime.sim.clock import EventQueue
from ddiloco.runtime.sim.faults import FaultHandlers
from ddiloco.runtime.sim.world import Network, StepTimes
from ddiloco.strategies import SimSettings
from ddiloco.trainer import Trainer, evaluate, sequence_length

# How fast the CPU syncer merges (bytes of answers per second) in virtual time.
SYNCER_BYTES_PER_SECOND = 2e9


@dataclass
class Node:
    """One learner slot: its trainer, its sync state, and whether it is up."""

    id: int
    trainer: Trainer
    sync: LearnerSync
    alive: bool = True
    life: int = 0
    asks: dict[int, int] = field(default_factory=dict)  # fragment -> round id
    inbox: dict[int, tuple[int, list[torch.Tensor]]] = field(default_factory=dict)
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)  # p -> (step, base) pushed
    blocked_since: float | None = None  # lock-step: waiting for a merged fragment
    frozen: bool = False
    next_step: float = 1.0  # duration of the step in progress (sampled when it starts)
    step_pending: bool = False  # a step ended while frozen
    down_since: float | None = None
    down_seconds: float = 0.0
    copying_from: int | None = None  # the peer whose state is being copied, if any
    attempt: int = 0  # recovery attempts, so an aborted copy's arrival is ignored


class FragmentSim(FaultHandlers):
    """Runs one fragment-synchronized experiment on the virtual clock."""

    def __init__(
        self,
        config: RunConfig,
        settings: SimSettings,
        splits: TokenSplits,
        eval_batches: list[tuple[torch.Tensor, torch.Tensor]],
        emit: Callable[[dict[str, Any]], None],
    ) -> None:
        self.config = config
        self.settings = settings
        self.sync = settings.sync
        self.emit = emit
        self.eval_batches = eval_batches
        self.clock = EventQueue()
        slots = config.train.learners + config.train.scavenged
        self.step_times = StepTimes(config.hardware, slots, random.Random(config.seed))
        self.network = Network(config.network)
        torch.manual_seed(config.seed)
        reference = build_model(config.model)
        self.plan: FragmentPlan = self.sync.fragment_plan(reference)
        self.ledger = TokenLedger(self.plan.num_fragments)
        self.syncer = SyncerState(
            self.plan,
            dict(reference.named_parameters()),
            self.sync.syncer_config(),
            plain_tensors=embedding_names(reference),
            ledger=self.ledger,
        )
        self.eval_model = reference
        self.seq_len = sequence_length(reference)
        t = config.train
        steps_each = t.tokens // (t.learners * t.batch_size * self.seq_len)
        self.nodes: list[Node] = []
        for m in range(slots):
            model = build_model(config.model)
            model.load_state_dict(reference.state_dict())  # every replica starts from Theta_0
            stream = BatchStream(splits.shards[m], t.batch_size, self.seq_len, config.seed + m)
            trainer = Trainer(model, stream, t, steps_each)
            sync = LearnerSync(m, self.plan, trainer.params(), blend=self.sync.blend)
            present = m < t.learners  # scavenged slots start absent and join later
            self.nodes.append(Node(m, trainer, sync, alive=present, down_since=None))
            if present:
                self.syncer.policy.join(m)
        self.tokens = 0
        self.next_eval = 0
        self.finished = False
        self.bytes_up = 0
        self.bytes_down = 0
        self.bytes_peer = 0
        self.wakes: set[float] = set()
        self.alive_since = 0.0
        self.up_seconds = 0.0  # virtual time with >= K learners alive
        self.idle_seconds = 0.0  # lock-step waiting, summed over learners

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.evaluate()
        for node in self.nodes:
            if node.alive:
                self.clock.at(self.step_times.sample(node.id), self._step_done, node.id, node.life)
        for event in self.config.chaos:
            self.clock.at(event.at, self.on_chaos, event)
        while not self.finished and self.clock.step():
            pass
        self.account_uptime()
        for node in self.nodes:
            if node.blocked_since is not None:
                self.idle_seconds += self.clock.now - node.blocked_since
        self.ledger.close()
        final = self.evaluate()
        return summarize(self, final)

    # -- learners ---------------------------------------------------------------------------
    def _step_done(self, m: int, life: int) -> None:
        node = self.nodes[m]
        if not node.alive or node.life != life or self.finished:
            return
        if node.frozen:  # the step finished computing as the process was stopped
            node.step_pending = True
            return
        now = self.clock.now
        loss, tokens = node.trainer.train_step()
        node.sync.stepped(tokens)
        self.ledger.trained(m, tokens)
        self.tokens += tokens
        self.emit({"kind": "step", "t": now, "learner": m, "step": node.sync.step, "loss": loss})
        self.send_progress(node)
        self.at_boundary(node)
        if self.tokens >= self.next_eval:
            self.evaluate()
        limit = self.config.train.max_virtual_seconds
        if self.tokens >= self.config.train.tokens or (limit and now >= limit):
            self.finished = True
            return
        self.continue_or_wait(node)

    def send_progress(self, node: Node) -> None:
        step_seconds = self.step_times.sample(node.id)
        node.next_step = step_seconds
        latency = self.config.network.latency_seconds
        self.clock.after(
            latency, self._progress_arrive, node.id, node.life, node.sync.step, step_seconds
        )

    def at_boundary(self, node: Node, step_end: bool = True) -> None:
        """Between two steps: answer what was asked (after the step it was in), then apply
        merged fragments that arrived (the answer keeps the progress they overwrite).
        ``step_end`` is False when a waiting learner is woken up at the same boundary again."""
        if self.settings.lockstep and step_end:  # push on its own schedule, once per step
            for p in self.plan.due(node.sync.step):
                if node.sync.step > 0 and p not in node.sent:
                    self._send_answer(node, p, UNSOLICITED)
        for p, round_id in sorted(node.asks.items()):
            # lock-step learners answer an ask only for what they have not pushed on this
            # base: a newcomer owes the rounds that opened while it was away
            if not (self.settings.lockstep and p in node.sent):
                self._send_answer(node, p, round_id)
        node.asks.clear()
        for p, (version, values) in sorted(node.inbox.items()):
            if node.sync.apply(p, version, values, node.trainer.params()):
                self.ledger.rebased(node.id, p)
                node.sent.pop(p, None)
        node.inbox.clear()

    def continue_or_wait(self, node: Node) -> None:
        """Start the next step, unless lock-step says to wait for a merged fragment."""
        if self.settings.lockstep and self._must_wait(node):
            node.blocked_since = self.clock.now
            return
        self.clock.after(node.next_step, self._step_done, node.id, node.life)

    def _must_wait(self, node: Node) -> bool:
        overlap = self.sync.overlap
        return any(node.sync.step - step >= overlap for step, _ in node.sent.values())

    def _send_answer(self, node: Node, p: int, round_id: int) -> None:
        snap = node.sync.answer(p, round_id, node.trainer.params())
        payload = encode_tensors(snap.delta, self.sync.codec_spec())
        self.ledger.answered(node.id, p, snap.meta.key, snap.meta.c_tokens)
        node.sent[p] = (node.sync.step, node.sync.versions[p])
        self.bytes_up += len(payload)
        arrival = self.network.up(node.id, self.clock.now, len(payload))
        self.clock.at(arrival, self._answer_arrive, node.id, node.life, snap.meta, payload)

    def ask_arrive(self, m: int, life: int, p: int, round_id: int) -> None:
        node = self.nodes[m]
        if node.alive and node.life == life:
            node.asks[p] = round_id
            if node.blocked_since is not None:  # a waiting learner answers right away
                self._unblock_check(node)

    def broadcast_arrive(
        self, m: int, life: int, p: int, version: int, values: list[torch.Tensor]
    ) -> None:
        node = self.nodes[m]
        if not (node.alive and node.life == life):
            return
        held = node.inbox.get(p)
        if held is None or held[0] < version:
            node.inbox[p] = (version, values)
        if node.blocked_since is not None:
            self._unblock_check(node)

    def _unblock_check(self, node: Node) -> None:
        if node.frozen:
            return
        self.at_boundary(node, step_end=False)
        if not self._must_wait(node):
            self.idle_seconds += self.clock.now - (node.blocked_since or self.clock.now)
            node.blocked_since = None
            self.clock.after(node.next_step, self._step_done, node.id, node.life)

    # -- syncer -----------------------------------------------------------------------------
    def _progress_arrive(self, m: int, life: int, step: int, step_seconds: float) -> None:
        node = self.nodes[m]
        if node.life != life or m not in self.syncer.policy.progress:
            return
        latency = self.config.network.latency_seconds
        for rnd in self.syncer.on_progress(m, step, self.clock.now, step_seconds):
            for a in sorted(rnd.asked):
                life_a = self.nodes[a].life
                self.clock.after(latency, self.ask_arrive, a, life_a, rnd.fragment, rnd.round_id)
        self.poll()

    def _answer_arrive(self, m: int, life: int, meta: AnswerMeta, payload: bytes) -> None:
        if self.nodes[m].life != life:  # the learner died while this was on the wire
            self.ledger.wasted_answer(meta.key, reasons.LOST_IN_FLIGHT)
            return
        verdict = self.syncer.on_answer(meta, decode_tensors(payload), self.clock.now)
        if verdict not in (Verdict.ACCEPTED, Verdict.WAITING):
            self.emit({"kind": "drop", "t": self.clock.now, "learner": m,
                       "fragment": meta.fragment, "verdict": verdict.value})  # fmt: skip
        self.poll()

    def poll(self) -> None:
        """Merge every round that is ready; wake up again at the next grace deadline."""
        for result in self.syncer.poll(self.clock.now):
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
        payload = encode_tensors(result.tensors, self.sync.broadcast_spec())
        values = decode_tensors(payload)  # what every learner receives
        last = now + merge_seconds
        for m in sorted(self.syncer.policy.progress):
            arrival = self.network.down(m, now + merge_seconds, len(payload))
            self.bytes_down += len(payload)
            last = max(last, arrival)
            copy = [v.clone() for v in values]
            self.clock.at(arrival, self.broadcast_arrive, m, self.nodes[m].life,
                          result.fragment, result.version, copy)  # fmt: skip
        self.syncer.record_sync_time(last - now)
        self.emit({
            "kind": "round", "t": now, "fragment": result.fragment, "version": result.version,
            "opened_at": rnd.opened_at, "quorum_at": rnd.quorum_at, "grace": rnd.grace,
            "answers": len(rnd.answers), "asked": rnd.asked,
            "weights": {str(k): v for k, v in sorted(result.weights.items())},
            "update_norm": result.update_norm, "broadcast_bytes": len(payload),
        })  # fmt: skip

    def send_latest(self, node: Node, p: int) -> None:
        """The syncer sends fragment p's current version to one learner (a newcomer)."""
        payload = encode_tensors(self.syncer.fragments[p], self.sync.broadcast_spec())
        self.bytes_down += len(payload)
        arrival = self.network.down(node.id, self.clock.now, len(payload))
        self.clock.at(arrival, self.broadcast_arrive, node.id, node.life, p,
                      self.syncer.versions[p], decode_tensors(payload))  # fmt: skip

    # -- measurement ------------------------------------------------------------------------
    def evaluate(self) -> float:
        """Eval loss of the syncer's global parameters (DESIGN decision 6)."""
        params = dict(self.eval_model.named_parameters())
        for p in range(self.plan.num_fragments):
            scatter(self.plan, p, params, self.syncer.fragments[p])
        loss = evaluate(self.eval_model, self.eval_batches)
        self.emit({"kind": "eval", "t": self.clock.now, "tokens": self.tokens, "loss": loss})
        self.next_eval = self.tokens + self.config.train.eval_every
        return loss

    def account_uptime(self) -> None:
        now = self.clock.now
        if sum(n.alive for n in self.nodes) >= self.sync.quorum:
            self.up_seconds += now - self.alive_since
        self.alive_since = now
