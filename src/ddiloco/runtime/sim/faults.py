"""What the chaos plan does to the simulated world, and how learners come back.

Crash (the process dies: state lost, restarts after ``duration`` and copies a healthy peer;
node_loss is the same here, a learner's chips being its node), freeze (SIGSTOP: nothing runs
for ``duration``, state kept), slow (steps take ``factor`` longer), link_slow / link_cut (the
learner's links lose bandwidth or carry nothing for a while), join (a scavenged learner
arrives and copies a peer), leave (a learner goes away cleanly). A collaborator of the
engine: it moves slots between their named states
(:class:`~ddiloco.runtime.sim.node.NodeState`) and calls back into the engine only through
:class:`Engine`, the few things it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ddiloco.chaos.plan import ChaosEvent, chaos_record
from ddiloco.config import RunConfig
from ddiloco.core import ledger as reasons
from ddiloco.core.boundary import StepBoundary
from ddiloco.core.fragments import scatter
from ddiloco.core.learner_state import LearnerSync
from ddiloco.core.ledger import TokenLedger
from ddiloco.core.plans import FragmentPlan
from ddiloco.core.syncer_state import SyncerState
from ddiloco.runtime.sim.clock import EventQueue
from ddiloco.runtime.sim.node import Node, NodeState
from ddiloco.runtime.sim.world import Network, StepTimes


class Engine(Protocol):
    """What the faults use of the engine (:class:`~ddiloco.runtime.sim.engine.FragmentSim`)."""

    config: RunConfig
    clock: EventQueue
    nodes: list[Node]
    plan: FragmentPlan
    syncer: SyncerState
    ledger: TokenLedger
    network: Network
    step_times: StepTimes
    emit: Callable[[dict[str, Any]], None]
    idle_seconds: float
    bytes_peer: int

    def boundary_of(self, sync: LearnerSync) -> StepBoundary: ...
    def step_done(self, m: int, incarnation: int) -> None: ...
    def wake(self, node: Node) -> None: ...
    def poll(self) -> None: ...
    def account_uptime(self) -> None: ...
    def ask_arrive(self, m: int, incarnation: int, p: int, round_id: int) -> None: ...
    def send_latest(self, node: Node, p: int) -> None: ...


class Faults:
    """Chaos events and recovery for the fragment-sync engine."""

    def __init__(self, engine: Engine) -> None:
        self.sim = engine

    def strike(self, event: ChaosEvent) -> None:
        """A chaos event, now."""
        sim = self.sim
        node = sim.nodes[event.learner]
        sim.emit(chaos_record(event, sim.clock.now))
        handler = {
            "crash": self._crash,
            "node_loss": self._crash,  # (a learner's chips are its node here)
            "freeze": self._freeze,
            "slow": self._slow,
            "link_slow": self._link,
            "link_cut": self._link,
            "join": self._join,
            "leave": self._leave,
            "preempt": self._preempt,
        }[event.kind]
        handler(node, event)

    # -- slow things down -------------------------------------------------------------------
    def _slow(self, node: Node, event: ChaosEvent) -> None:
        self.sim.step_times.slowdown[node.id] = event.factor
        if event.duration > 0:
            self.sim.clock.after(event.duration, self._restore_speed, node.id)

    def _restore_speed(self, m: int) -> None:
        self.sim.step_times.slowdown[m] = 1.0

    def _link(self, node: Node, event: ChaosEvent) -> None:
        sim = self.sim
        if event.kind == "link_cut":
            sim.network.cut(node.id, sim.clock.now + event.duration)
        else:
            sim.network.slow(node.id, event.factor)
            if event.duration > 0:
                sim.clock.after(event.duration, sim.network.slow, node.id, 1.0)

    def _freeze(self, node: Node, event: ChaosEvent) -> None:
        if not node.up or node.frozen:
            return
        node.frozen = True
        sim = self.sim
        detect = sim.config.network.detect_seconds
        if event.duration > detect:  # its heartbeats stop: the syncer gives up on it
            sim.clock.after(detect, self._detected, node.id, node.incarnation)
        sim.clock.after(event.duration, self._thaw, node.id, node.incarnation)

    def _thaw(self, m: int, incarnation: int) -> None:
        sim = self.sim
        node = sim.nodes[m]
        if node.incarnation != incarnation or not node.frozen:
            return
        node.frozen = False
        if m not in sim.syncer.live:  # it had been given up on: register again
            self._rejoin(node)
        if node.step_pending:
            node.step_pending = False
            sim.clock.after(0.0, sim.step_done, m, incarnation)
        elif node.state is NodeState.WAITING:
            sim.wake(node)

    # -- lose a learner ---------------------------------------------------------------------
    def _crash(self, node: Node, event: ChaosEvent) -> None:
        if not node.up:
            return
        sim = self.sim
        self._drop(node, reasons.CRASH, NodeState.DOWN)
        sim.clock.after(
            sim.config.network.detect_seconds, self._detected, node.id, node.incarnation
        )
        sim.clock.after(event.duration, self._restart, node.id, node.incarnation)

    def _leave(self, node: Node, event: ChaosEvent) -> None:
        """A clean leave: it says goodbye, so the syncer stops waiting for it at once."""
        if not node.up:
            return
        sim = self.sim
        self._drop(node, reasons.LEFT, NodeState.ABSENT)
        node.down_since = None  # no longer allocated: not counted as lost capacity
        sim.syncer.leave(node.id, sim.clock.now)
        sim.poll()

    def _preempt(self, node: Node, event: ChaosEvent) -> None:
        """Reclaimed with notice: it says goodbye (no detection wait, as a leave), is down
        (lost capacity, as a crash) and is back after ``duration``, copying a peer."""
        if not node.up:
            return
        sim = self.sim
        self._drop(node, reasons.LEFT, NodeState.DOWN)
        sim.syncer.leave(node.id, sim.clock.now)
        sim.poll()
        sim.clock.after(event.duration, self._restart, node.id, node.incarnation)

    def _drop(self, node: Node, reason: str, state: NodeState) -> None:
        sim = self.sim
        for other in sim.nodes:  # whoever was copying this learner's state starts over
            if other.copying_from == node.id:
                self._restart(other.id, other.incarnation)
        now = sim.clock.now
        sim.account_uptime()
        if node.waiting_since is not None:
            sim.idle_seconds += now - node.waiting_since
        node.state = state
        node.frozen = False
        node.step_pending = False
        node.waiting_since = None
        node.incarnation += 1
        node.down_since = now
        node.asks.clear()
        node.inbox.clear()
        node.boundary.forget()
        sim.ledger.crashed(node.id, reason)
        sim.network.reset(node.id, now)

    def _detected(self, m: int, incarnation: int) -> None:
        sim = self.sim
        node = sim.nodes[m]
        if node.incarnation == incarnation and not node.running:
            sim.syncer.leave(m, sim.clock.now)
            sim.emit({"kind": "detected", "t": sim.clock.now, "learner": m})
            sim.poll()

    # -- come (back) ------------------------------------------------------------------------
    def _join(self, node: Node, event: ChaosEvent) -> None:
        if node.up:
            return
        node.incarnation += 1
        if node.down_since is None:
            node.down_since = self.sim.clock.now  # absent slots count from their first join
        self._restart(node.id, node.incarnation)

    def _restart(self, m: int, incarnation: int) -> None:
        """Register again and pull a full state from a healthy peer (or the syncer)."""
        sim = self.sim
        node = sim.nodes[m]
        if node.incarnation != incarnation or node.up:
            return
        peers = [n for n in sim.nodes if n.running and n.id not in (m, node.copying_from)]
        now = sim.clock.now
        node.state = NodeState.COPYING
        node.attempt += 1
        sim.network.reset(m, now)  # an aborted copy no longer occupies the link
        node.copying_from = peers[0].id if peers else None
        if peers:
            nbytes = peers[0].trainer.state_bytes()
            arrival = sim.network.peer(m, now, nbytes)
        else:
            nbytes = sim.plan.total_bytes
            arrival = sim.network.down(m, now, nbytes)
        sim.bytes_peer += nbytes
        sim.clock.at(arrival, self._recovered, m, incarnation, node.copying_from, node.attempt)

    def _recovered(self, m: int, incarnation: int, peer_id: int | None, attempt: int) -> None:
        sim = self.sim
        node = sim.nodes[m]
        if node.incarnation != incarnation or node.up or node.attempt != attempt:
            return
        node.copying_from = None
        if peer_id is not None:
            peer = sim.nodes[peer_id]
            node.trainer.load_state(peer.trainer.state())
            node.sync.load_peer_state(peer.sync.state_dict(), node.trainer.params())
            node.inbox = {p: (v, [t.clone() for t in vals]) for p, (v, vals) in peer.inbox.items()}
        else:  # nobody up: start from the syncer's global fragments, fresh inner state
            params = node.trainer.params()
            for p in range(sim.plan.num_fragments):
                scatter(sim.plan, p, params, sim.syncer.fragments[p])
            node.trainer.reset_optimizer()
            sync = LearnerSync(
                m,
                sim.plan,
                params,
                apply=node.sync.rule,
                blend=node.sync.blend,
                versions=sim.syncer.versions,
            )
            sync.step = sim.syncer.global_step
            node.boundary = sim.boundary_of(sync)
        node.sync.incarnation = incarnation
        sim.account_uptime()
        node.state = NodeState.STEPPING
        now = sim.clock.now
        node.down_seconds += now - (node.down_since if node.down_since is not None else now)
        node.down_since = None
        sim.emit({"kind": "recovered", "t": now, "learner": m, "peer": peer_id})
        self._rejoin(node)
        node.next_step = sim.step_times.sample(m)
        sim.clock.after(node.next_step, sim.step_done, m, incarnation)

    def _rejoin(self, node: Node) -> None:
        """Register with the syncer and get every fragment newer than what it holds."""
        sim = self.sim
        latency = sim.config.network.latency_seconds
        for rnd in sim.syncer.join(node.id, node.sync.step):
            sim.clock.after(
                latency, sim.ask_arrive, node.id, node.incarnation, rnd.fragment, rnd.round_id
            )
        for p in range(sim.plan.num_fragments):
            if sim.syncer.versions[p] > node.sync.versions[p]:
                sim.send_latest(node, p)
