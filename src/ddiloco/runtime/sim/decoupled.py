"""Decoupled DiLoCo on the simulated clock: M real learners, one syncer, virtual time.

Every rule comes from the core (``LearnerSync``, ``SyncerState``, the codec, the ledger);
this module only decides *when* things happen: a step ends after the hardware model's step
time, a message arrives after the network model's transfer time, a crash strikes when the
chaos plan says. Payloads really are encoded and decoded, so bytes and quantization error are
real. Same config and seed, same run, bit for bit.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ddiloco.config import ChaosEvent, RunConfig
from ddiloco.core import ledger as reasons
from ddiloco.core.codec import decode_tensors, encode_tensors
from ddiloco.core.learner_state import LearnerSync
from ddiloco.core.ledger import TokenLedger
from ddiloco.core.plans import FragmentPlan, build_plan, scatter, tensor_specs
from ddiloco.core.rounds import AnswerMeta, Verdict
from ddiloco.core.syncer_state import MergeResult, SyncerConfig, SyncerState
from ddiloco.data.corpus import BatchStream, TokenSplits
from ddiloco.models.gpt import embedding_names
from ddiloco.models.registry import build_model
from ddiloco.runtime.sim.clock import EventQueue
from ddiloco.runtime.sim.learner import Trainer, evaluate, sequence_length
from ddiloco.runtime.sim.world import Network, StepTimes

# Waste caused by failures (the rest is the algorithm's own: overlap overwrites, staleness).
FAILURE_REASONS = (reasons.CRASH, reasons.LOST_IN_FLIGHT)

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
    down_since: float | None = None
    down_seconds: float = 0.0
    copying_from: int | None = None  # the peer whose state is being copied, if any
    attempt: int = 0  # recovery attempts, so an aborted copy's arrival is ignored


class DecoupledSim:
    """Runs one Decoupled DiLoCo experiment on the virtual clock."""

    def __init__(
        self,
        config: RunConfig,
        splits: TokenSplits,
        eval_batches: list[tuple[torch.Tensor, torch.Tensor]],
        emit: Callable[[dict[str, Any]], None],
    ) -> None:
        self.config = config
        self.emit = emit
        self.eval_batches = eval_batches
        self.clock = EventQueue()
        rng = random.Random(config.seed)
        self.step_times = StepTimes(config.hardware, config.train.learners, rng)
        self.network = Network(config.network)
        torch.manual_seed(config.seed)
        reference = build_model(config.model)
        self.plan: FragmentPlan = build_plan(
            tensor_specs(reference),
            config.sync.fragments,
            config.sync.strategy,
            sync_every=config.sync.sync_every,
            split_rows=config.sync.split_rows and config.sync.strategy == "balanced",
        )
        self.ledger = TokenLedger(self.plan.num_fragments)
        self.syncer = SyncerState(
            self.plan,
            dict(reference.named_parameters()),
            SyncerConfig(config.sync.rounds(), config.sync.merge_rule, config.sync.outer()),
            plain_tensors=embedding_names(reference),
            ledger=self.ledger,
        )
        self.eval_model = reference
        self.seq_len = sequence_length(reference)
        t = config.train
        steps_each = t.tokens // (t.learners * t.batch_size * self.seq_len)
        self.nodes = []
        for m in range(t.learners):
            model = build_model(config.model)
            model.load_state_dict(reference.state_dict())  # every replica starts from Theta_0
            stream = BatchStream(splits.shards[m], t.batch_size, self.seq_len, config.seed + m)
            trainer = Trainer(model, stream, t, steps_each)
            sync = LearnerSync(m, self.plan, trainer.params(), blend=config.sync.blend)
            self.nodes.append(Node(m, trainer, sync))
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

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self._evaluate()
        for node in self.nodes:
            self.clock.at(self.step_times.sample(node.id), self._step_done, node.id, node.life)
        for event in self.config.chaos:
            self.clock.at(event.at, self._chaos, event)
        while not self.finished and self.clock.step():
            pass
        self._account_uptime()
        self.ledger.close()
        final = self._evaluate()
        return self._summary(final)

    # -- learners ---------------------------------------------------------------------------
    def _step_done(self, m: int, life: int) -> None:
        node = self.nodes[m]
        if not node.alive or node.life != life or self.finished:
            return
        now = self.clock.now
        loss, tokens = node.trainer.train_step()
        node.sync.stepped(tokens)
        self.ledger.trained(m, tokens)
        self.tokens += tokens
        step_seconds = self.step_times.sample(m)
        self.emit({"kind": "step", "t": now, "learner": m, "step": node.sync.step, "loss": loss})
        self.clock.after(
            self.config.network.latency_seconds,
            self._progress_arrive,
            m,
            life,
            node.sync.step,
            step_seconds,
        )
        for p, round_id in sorted(node.asks.items()):  # answer after the step it is in
            self._send_answer(node, p, round_id)
        node.asks.clear()
        for p, (version, values) in sorted(node.inbox.items()):  # apply between two steps
            if node.sync.apply(p, version, values, node.trainer.params()):
                self.ledger.rebased(m, p)
        node.inbox.clear()
        if self.tokens >= self.next_eval:
            self._evaluate()
        if self.tokens >= self.config.train.tokens:
            self.finished = True
            return
        self.clock.after(step_seconds, self._step_done, m, life)

    def _send_answer(self, node: Node, p: int, round_id: int) -> None:
        snap = node.sync.answer(p, round_id, node.trainer.params())
        payload = encode_tensors(snap.delta, self.config.sync.codec_spec())
        self.ledger.answered(node.id, p, snap.meta.key, snap.meta.c_tokens)
        self.bytes_up += len(payload)
        arrival = self.network.up(node.id, self.clock.now, len(payload))
        self.clock.at(arrival, self._answer_arrive, node.id, node.life, snap.meta, payload)

    def _ask_arrive(self, m: int, life: int, p: int, round_id: int) -> None:
        node = self.nodes[m]
        if node.alive and node.life == life:
            node.asks[p] = round_id

    def _broadcast_arrive(
        self, m: int, life: int, p: int, version: int, values: list[torch.Tensor]
    ) -> None:
        node = self.nodes[m]
        if node.alive and node.life == life:
            held = node.inbox.get(p)
            if held is None or held[0] < version:
                node.inbox[p] = (version, values)

    # -- syncer -----------------------------------------------------------------------------
    def _progress_arrive(self, m: int, life: int, step: int, step_seconds: float) -> None:
        node = self.nodes[m]
        if node.life != life or m not in self.syncer.policy.progress:
            return
        for rnd in self.syncer.on_progress(m, step, self.clock.now, step_seconds):
            for a in sorted(rnd.asked):
                latency = self.config.network.latency_seconds
                self.clock.after(
                    latency, self._ask_arrive, a, self.nodes[a].life, rnd.fragment, rnd.round_id
                )
        self._poll()

    def _answer_arrive(self, m: int, life: int, meta: AnswerMeta, payload: bytes) -> None:
        if self.nodes[m].life != life:  # the learner died while this was on the wire
            self.ledger.wasted_answer(meta.key, reasons.LOST_IN_FLIGHT)
            return
        delta = decode_tensors(payload)
        verdict = self.syncer.on_answer(meta, delta, self.clock.now)
        if verdict is not Verdict.ACCEPTED and verdict is not Verdict.WAITING:
            self.emit(
                {
                    "kind": "drop",
                    "t": self.clock.now,
                    "learner": m,
                    "fragment": meta.fragment,
                    "verdict": verdict.value,
                }
            )
        self._poll()

    def _poll(self) -> None:
        now = self.clock.now
        for result in self.syncer.poll(now):
            self._broadcast(result)
        deadline = self.syncer.next_deadline()
        if deadline is not None and deadline not in self.wakes:
            self.wakes.add(deadline)
            self.clock.at(deadline, self._wake, deadline)

    def _wake(self, deadline: float) -> None:
        self.wakes.discard(deadline)
        self._poll()

    def _broadcast(self, result: MergeResult) -> None:
        now = self.clock.now
        rnd = result.round
        merge_seconds = (
            sum(t.numel() * 4 for t in result.tensors)
            * max(len(rnd.answers), 1)
            / (SYNCER_BYTES_PER_SECOND)
        )
        payload = encode_tensors(result.tensors, self.config.sync.broadcast_spec())
        values = decode_tensors(payload)  # what every learner receives
        last = now + merge_seconds
        for m in sorted(self.syncer.policy.progress):
            arrival = self.network.down(m, now + merge_seconds, len(payload))
            self.bytes_down += len(payload)
            last = max(last, arrival)
            node = self.nodes[m]
            copy = [v.clone() for v in values]
            self.clock.at(
                arrival, self._broadcast_arrive, m, node.life, result.fragment, result.version, copy
            )
        self.syncer.record_sync_time(last - now)
        self.emit(
            {
                "kind": "round",
                "t": now,
                "fragment": result.fragment,
                "version": result.version,
                "opened_at": rnd.opened_at,
                "quorum_at": rnd.quorum_at,
                "grace": rnd.grace,
                "answers": len(rnd.answers),
                "asked": rnd.asked,
                "weights": {str(k): v for k, v in sorted(result.weights.items())},
                "update_norm": result.update_norm,
                "broadcast_bytes": len(payload),
            }
        )

    # -- chaos and recovery -----------------------------------------------------------------
    def _chaos(self, event: ChaosEvent) -> None:
        node = self.nodes[event.learner]
        now = self.clock.now
        self.emit(
            {
                "kind": "chaos",
                "t": now,
                "event": event.kind,
                "learner": event.learner,
                "duration": event.duration,
                "factor": event.factor,
            }
        )
        if event.kind == "slow":
            self.step_times.slowdown[event.learner] = event.factor
            if event.duration > 0:
                self.clock.after(event.duration, self._unslow, event.learner)
            return
        if not node.alive:
            return
        for other in self.nodes:  # whoever was copying this learner's state starts over
            if other.copying_from == node.id:
                self._restart(other.id, other.life)
        self._account_uptime()
        node.alive = False
        node.life += 1
        node.down_since = now
        node.asks.clear()
        node.inbox.clear()
        self.ledger.crashed(node.id)
        self.network.reset(node.id, now)
        self.clock.after(self.config.network.detect_seconds, self._detected, node.id, node.life)
        self.clock.after(max(event.duration, 0.0), self._restart, node.id, node.life)

    def _unslow(self, m: int) -> None:
        self.step_times.slowdown[m] = 1.0

    def _detected(self, m: int, life: int) -> None:
        if self.nodes[m].life == life and not self.nodes[m].alive:
            self.syncer.policy.leave(m, self.clock.now)
            self._poll()

    def _restart(self, m: int, life: int) -> None:
        """Register again and pull a full state from a healthy peer (or the syncer)."""
        node = self.nodes[m]
        if node.life != life or node.alive:
            return
        peers = [n for n in self.nodes if n.alive and n.id != m and n.id != node.copying_from]
        now = self.clock.now
        node.attempt += 1
        self.network.reset(m, now)  # an aborted copy no longer occupies the link
        node.copying_from = peers[0].id if peers else None
        if peers:
            peer = peers[0]
            nbytes = peer.trainer.state_bytes()
            arrival = self.network.peer(m, now, nbytes)
        else:
            peer = None
            nbytes = self.plan.total_bytes
            arrival = self.network.down(m, now, nbytes)
        self.bytes_peer += nbytes
        self.clock.at(arrival, self._recovered, m, life, node.copying_from, node.attempt)

    def _recovered(self, m: int, life: int, peer_id: int | None, attempt: int) -> None:
        node = self.nodes[m]
        if node.life != life or node.alive or node.attempt != attempt:
            return
        node.copying_from = None
        now = self.clock.now
        if peer_id is not None:
            peer = self.nodes[peer_id]
            node.trainer.load_state(peer.trainer.state())
            node.sync.load_peer_state(peer.sync.state_dict())
            node.inbox = {p: (v, [t.clone() for t in vals]) for p, (v, vals) in peer.inbox.items()}
        else:  # nobody alive: start from the syncer's global fragments, fresh inner state
            params = node.trainer.params()
            for p in range(self.plan.num_fragments):
                scatter(self.plan, p, params, self.syncer.fragments[p])
            node.sync = LearnerSync(
                m, self.plan, params, blend=self.config.sync.blend, versions=self.syncer.versions
            )
            node.sync.step = max(self.syncer.policy.global_step, 0)
        node.sync.incarnation = life
        self._account_uptime()
        node.alive = True
        node.down_seconds += now - (node.down_since or now)
        node.down_since = None
        self.syncer.policy.join(m, node.sync.step)
        self.emit({"kind": "recovered", "t": now, "learner": m, "peer": peer_id})
        for p in range(self.plan.num_fragments):  # anything newer than what it now holds
            if self.syncer.versions[p] > node.sync.versions[p]:
                self._send_latest(node, p)
        self.clock.after(self.step_times.sample(m), self._step_done, m, life)

    def _send_latest(self, node: Node, p: int) -> None:
        payload = encode_tensors(self.syncer.fragments[p], self.config.sync.broadcast_spec())
        self.bytes_down += len(payload)
        arrival = self.network.down(node.id, self.clock.now, len(payload))
        self.clock.at(
            arrival,
            self._broadcast_arrive,
            node.id,
            node.life,
            p,
            self.syncer.versions[p],
            decode_tensors(payload),
        )

    # -- measurement ------------------------------------------------------------------------
    def _account_uptime(self) -> None:
        now = self.clock.now
        if sum(n.alive for n in self.nodes) >= self.config.sync.quorum:
            self.up_seconds += now - self.alive_since
        self.alive_since = now

    def _evaluate(self) -> float:
        params = dict(self.eval_model.named_parameters())
        for p in range(self.plan.num_fragments):
            scatter(self.plan, p, params, self.syncer.fragments[p])
        loss = evaluate(self.eval_model, self.eval_batches)
        self.emit({"kind": "eval", "t": self.clock.now, "tokens": self.tokens, "loss": loss})
        self.next_eval = self.tokens + self.config.train.eval_every
        return loss

    def _summary(self, final_loss: float) -> dict[str, Any]:
        ledger = self.ledger.summary()
        now = self.clock.now
        t = self.config.train
        per_step = t.batch_size * self.seq_len
        lost_capacity = 0.0
        for n in self.nodes:
            down = n.down_seconds + (now - n.down_since if n.down_since is not None else 0.0)
            step = self.config.hardware.step_seconds * self.step_times.speed[n.id]
            lost_capacity += down / step * per_step
        merged = float(ledger["tokens_merged"])  # type: ignore[arg-type]
        wasted: dict[str, float] = ledger["tokens_wasted"]  # type: ignore[assignment]
        lost_to_failures = sum(wasted.get(r, 0.0) for r in FAILURE_REASONS)
        return {
            "method": "decoupled",
            "eval_loss": final_loss,
            "tokens": self.tokens,
            "tokens_merged": merged,
            "tokens_wasted": ledger["tokens_wasted"],
            "ledger_balanced": ledger["balanced"],
            # useful compute / allocated compute: tokens trained and not lost to a failure,
            # over the tokens every learner could have trained had it never been down
            "goodput": (self.tokens - lost_to_failures) / max(self.tokens + lost_capacity, 1.0),
            "token_efficiency": merged / max(self.tokens, 1),
            "uptime": self.up_seconds / now if now > 0 else 1.0,
            "virtual_seconds": now,
            "bytes_sent": self.bytes_up,
            "bytes_received": self.bytes_down,
            "bytes_peer_recovery": self.bytes_peer,
            "bytes_per_token": (self.bytes_up + self.bytes_down) / max(self.tokens, 1),
            "rounds": self.syncer.counts.get("merged_rounds", 0),
            "answers": {k: v for k, v in sorted(self.syncer.counts.items())},
            "plan": {
                "fragments": self.plan.num_fragments,
                "imbalance": self.plan.imbalance,
                "peak_bytes_per_step": self.plan.peak_bytes_per_step,
            },
        }
