"""What the chaos plan does to the simulated world, and how learners come back.

Crash (the process dies: state lost, restarts after ``duration`` and copies a healthy peer),
freeze (SIGSTOP: nothing runs for ``duration``, state kept), slow (steps take ``factor``
longer), link_slow / link_cut (the learner's links lose bandwidth or carry nothing for a
while), join (a scavenged learner arrives and copies a peer), leave (a learner goes away
cleanly). A mixin of :class:`~ddiloco.runtime.sim.engine.FragmentSim`: it shares its state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddiloco.config import ChaosEvent
from ddiloco.core import ledger as reasons
from ddiloco.core.learner_state import LearnerSync
from ddiloco.core.plans import scatter

if TYPE_CHECKING:
    from ddiloco.runtime.sim.engine import FragmentSim, Node


class FaultHandlers:
    """Chaos events and recovery for the fragment-sync engine."""

    def on_chaos(self: FragmentSim, event: ChaosEvent) -> None:
        node = self.nodes[event.learner]
        self.emit({"kind": "chaos", "t": self.clock.now, "event": event.kind,
                   "learner": event.learner, "duration": event.duration,
                   "factor": event.factor})  # fmt: skip
        handler = {
            "crash": self._crash,
            "freeze": self._freeze,
            "slow": self._slow,
            "link_slow": self._link,
            "link_cut": self._link,
            "join": self._join,
            "leave": self._leave,
        }[event.kind]
        handler(node, event)

    # -- slow things down -------------------------------------------------------------------
    def _slow(self: FragmentSim, node: Node, event: ChaosEvent) -> None:
        self.step_times.slowdown[node.id] = event.factor
        if event.duration > 0:
            self.clock.after(event.duration, self._restore_speed, node.id)

    def _restore_speed(self: FragmentSim, m: int) -> None:
        self.step_times.slowdown[m] = 1.0

    def _link(self: FragmentSim, node: Node, event: ChaosEvent) -> None:
        now = self.clock.now
        if event.kind == "link_cut":
            self.network.cut(node.id, now + event.duration)
        else:
            self.network.slow(node.id, event.factor)
            if event.duration > 0:
                self.clock.after(event.duration, self.network.slow, node.id, 1.0)

    def _freeze(self: FragmentSim, node: Node, event: ChaosEvent) -> None:
        if not node.alive or node.frozen:
            return
        node.frozen = True
        detect = self.config.network.detect_seconds
        if event.duration > detect:  # its heartbeats stop: the syncer gives up on it
            self.clock.after(detect, self._detected, node.id, node.life)
        self.clock.after(event.duration, self._thaw, node.id, node.life)

    def _thaw(self: FragmentSim, m: int, life: int) -> None:
        node = self.nodes[m]
        if node.life != life or not node.frozen:
            return
        node.frozen = False
        if m not in self.syncer.policy.progress:  # it had been given up on: register again
            self._rejoin(node)
        if node.step_pending:
            node.step_pending = False
            self.clock.after(0.0, self._step_done, m, life)
        elif node.blocked_since is not None:
            self._unblock_check(node)

    # -- lose a learner ---------------------------------------------------------------------
    def _crash(self: FragmentSim, node: Node, event: ChaosEvent) -> None:
        if not node.alive:
            return
        self._drop(node, reasons.CRASH)
        self.clock.after(self.config.network.detect_seconds, self._detected, node.id, node.life)
        self.clock.after(event.duration, self._restart, node.id, node.life)

    def _leave(self: FragmentSim, node: Node, event: ChaosEvent) -> None:
        """A clean leave: it says goodbye, so the syncer stops waiting for it at once."""
        if not node.alive:
            return
        self._drop(node, reasons.LEFT)
        node.down_since = None  # no longer allocated: not counted as lost capacity
        self.syncer.policy.leave(node.id, self.clock.now)
        self.poll()

    def _drop(self: FragmentSim, node: Node, reason: str) -> None:
        for other in self.nodes:  # whoever was copying this learner's state starts over
            if other.copying_from == node.id:
                self._restart(other.id, other.life)
        now = self.clock.now
        self.account_uptime()
        if node.blocked_since is not None:
            self.idle_seconds += now - node.blocked_since
        node.alive = False
        node.frozen = False
        node.step_pending = False
        node.blocked_since = None
        node.life += 1
        node.down_since = now
        node.asks.clear()
        node.inbox.clear()
        node.sent.clear()
        self.ledger.crashed(node.id, reason)
        self.network.reset(node.id, now)

    def _detected(self: FragmentSim, m: int, life: int) -> None:
        node = self.nodes[m]
        if node.life == life and (not node.alive or node.frozen):
            self.syncer.policy.leave(m, self.clock.now)
            self.emit({"kind": "detected", "t": self.clock.now, "learner": m})
            self.poll()

    # -- come (back) ------------------------------------------------------------------------
    def _join(self: FragmentSim, node: Node, event: ChaosEvent) -> None:
        if node.alive:
            return
        node.life += 1
        if node.down_since is None:
            node.down_since = self.clock.now  # absent slots count from their first join only
        self._restart(node.id, node.life)

    def _restart(self: FragmentSim, m: int, life: int) -> None:
        """Register again and pull a full state from a healthy peer (or the syncer)."""
        node = self.nodes[m]
        if node.life != life or node.alive:
            return
        peers = [
            n for n in self.nodes
            if n.alive and not n.frozen and n.id != m and n.id != node.copying_from
        ]  # fmt: skip
        now = self.clock.now
        node.attempt += 1
        self.network.reset(m, now)  # an aborted copy no longer occupies the link
        node.copying_from = peers[0].id if peers else None
        if peers:
            nbytes = peers[0].trainer.state_bytes()
            arrival = self.network.peer(m, now, nbytes)
        else:
            nbytes = self.plan.total_bytes
            arrival = self.network.down(m, now, nbytes)
        self.bytes_peer += nbytes
        self.clock.at(arrival, self._recovered, m, life, node.copying_from, node.attempt)

    def _recovered(self: FragmentSim, m: int, life: int, peer_id: int | None, attempt: int) -> None:
        node = self.nodes[m]
        if node.life != life or node.alive or node.attempt != attempt:
            return
        node.copying_from = None
        if peer_id is not None:
            peer = self.nodes[peer_id]
            node.trainer.load_state(peer.trainer.state())
            node.sync.load_peer_state(peer.sync.state_dict())
            node.inbox = {p: (v, [t.clone() for t in vals]) for p, (v, vals) in peer.inbox.items()}
        else:  # nobody alive: start from the syncer's global fragments, fresh inner state
            params = node.trainer.params()
            for p in range(self.plan.num_fragments):
                scatter(self.plan, p, params, self.syncer.fragments[p])
            node.trainer.reset_optimizer()
            node.sync = LearnerSync(m, self.plan, params, blend=self.sync.blend,
                                    versions=self.syncer.versions)  # fmt: skip
            node.sync.step = self.syncer.policy.global_step
        node.sync.incarnation = life
        self.account_uptime()
        node.alive = True
        now = self.clock.now
        node.down_seconds += now - (node.down_since if node.down_since is not None else now)
        node.down_since = None
        self.emit({"kind": "recovered", "t": now, "learner": m, "peer": peer_id})
        self._rejoin(node)
        node.next_step = self.step_times.sample(m)
        self.clock.after(node.next_step, self._step_done, m, life)

    def _rejoin(self: FragmentSim, node: Node) -> None:
        """Register with the syncer and get every fragment newer than what it holds."""
        latency = self.config.network.latency_seconds
        for rnd in self.syncer.policy.join(node.id, node.sync.step):
            self.clock.after(latency, self.ask_arrive, node.id, node.life, rnd.fragment,
                             rnd.round_id)  # fmt: skip
        for p in range(self.plan.num_fragments):
            if self.syncer.versions[p] > node.sync.versions[p]:
                self.send_latest(node, p)
