"""What a learner knows about synchronization, without any I/O.

The learner trains on its own; this object keeps, per fragment, the base version it last
received (and a copy of those global values, to compute its delta against), the step and
token counters since that base, and the sequence numbers of its answers. Runtimes call
``stepped`` after every training step, ``answer`` when the syncer asks for a fragment (after
the step in progress), and ``apply`` when a merged fragment arrives between two steps.

How a merged fragment Theta_p meets the learner's own theta_p is the apply rule
(docs/decisions.md 68):

* ``overwrite`` (the paper): theta_p <- Theta_p; the steps made since the last answer's
  snapshot S_p are lost (the ledger counts them "overwritten");
* ``blend`` (Streaming DiLoCo): theta_p <- alpha * theta_p + (1 - alpha) * Theta_p; the kept
  share is not credited to any answer (also counted "overwritten");
* ``carry``: theta_p <- Theta_p + (theta_p - S_p): the progress made since the snapshot the
  syncer has (or never had: S_p is the base then) is kept, and so are its step and token
  counters, so it rides with the learner's next answer (the ledger counts it "carried").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ddiloco.core.fragments import gather, scatter
from ddiloco.core.plans import FragmentPlan
from ddiloco.core.rounds import AnswerMeta
from ddiloco.errors import ConfigError, require

APPLY_RULES = ("overwrite", "blend", "carry")


@dataclass(frozen=True)
class Answer:
    """An answer ready to encode and send: metadata plus delta = theta - Theta_base (fp32)."""

    meta: AnswerMeta
    delta: list[torch.Tensor]


class LearnerSync:
    """One learner's synchronization state."""

    def __init__(
        self,
        learner: int,
        plan: FragmentPlan,
        params: Mapping[str, torch.Tensor],
        *,
        incarnation: int = 0,
        apply: str = "overwrite",
        blend: float = 0.5,
        versions: Sequence[int] | None = None,
    ) -> None:
        require(apply in APPLY_RULES, "apply", apply, f"known: {APPLY_RULES}")
        require(0.0 < blend < 1.0, "blend", blend, "alpha must be in (0, 1)")
        self.learner = learner
        self.plan = plan
        self.incarnation = incarnation
        self.rule = apply
        self.blend = blend
        p = plan.num_fragments
        self.versions = list(versions) if versions is not None else [0] * p
        require(len(self.versions) == p, "versions", self.versions, f"need {p} entries")
        with torch.no_grad():
            self.bases = [
                [t.detach().to("cpu", torch.float32, copy=True) for t in gather(plan, f, params)]
                for f in range(p)
            ]
        self.c_steps = [0] * p
        self.c_tokens = [0] * p
        # carry: per fragment, the values and counters of the last answer on the current base
        self.snapshots: list[list[torch.Tensor] | None] = [None] * p
        self.snapshot_counters = [(0, 0)] * p  # (c_steps, c_tokens) at that answer
        self.seq = 0
        self.step = 0

    def stepped(self, tokens: int) -> None:
        """One inner step on ``tokens`` tokens finished: every fragment's counters move."""
        require(tokens >= 0, "tokens", tokens, "must be >= 0")
        self.step += 1
        for f in range(self.plan.num_fragments):
            self.c_steps[f] += 1
            self.c_tokens[f] += tokens

    @torch.no_grad()
    def answer(self, fragment: int, round_id: int, params: Mapping[str, torch.Tensor]) -> Answer:
        """Snapshot ``fragment`` now: its delta against the base, with the counters."""
        self._check(fragment)
        current = gather(self.plan, fragment, params)
        delta = [
            c.detach().to("cpu", torch.float32, copy=True).sub_(b)
            for c, b in zip(current, self.bases[fragment], strict=True)
        ]
        meta = AnswerMeta(
            learner=self.learner,
            incarnation=self.incarnation,
            seq=self.seq,
            fragment=fragment,
            round_id=round_id,
            base_version=self.versions[fragment],
            local_step=self.step,
            c_steps=self.c_steps[fragment],
            c_tokens=self.c_tokens[fragment],
        )
        self.seq += 1
        self.snapshot(fragment, params)
        return Answer(meta, delta)

    @torch.no_grad()
    def snapshot(self, fragment: int, params: Mapping[str, torch.Tensor]) -> None:
        """Under ``carry``, remember ``fragment``'s values and counters now: what the syncer
        has of this learner (:meth:`answer` calls it; so does every other rank of a learner,
        at the fragments rank 0 answered, to stay identical). Other rules keep nothing."""
        self._check(fragment)
        if self.rule != "carry":
            return
        self.snapshots[fragment] = [
            t.detach().to("cpu", torch.float32, copy=True)
            for t in gather(self.plan, fragment, params)
        ]
        self.snapshot_counters[fragment] = (self.c_steps[fragment], self.c_tokens[fragment])

    @torch.no_grad()
    def apply(
        self,
        fragment: int,
        version: int,
        values: Sequence[torch.Tensor],
        params: Mapping[str, torch.Tensor],
    ) -> bool:
        """A merged fragment arrived: apply it by the rule, rebase, move the counters (to
        zero, or past the snapshot under ``carry``). An older version than the one held is
        ignored (returns False)."""
        self._check(fragment)
        if version <= self.versions[fragment]:
            return False
        expected = self.bases[fragment]
        if len(values) != len(expected) or any(
            v.shape != e.shape for v, e in zip(values, expected, strict=True)
        ):
            raise ConfigError("values", len(values), f"do not match fragment {fragment}'s shapes")
        new_base = [v.detach().to("cpu", torch.float32, copy=True) for v in values]
        steps, tokens = 0, 0
        if self.rule == "overwrite":
            scatter(self.plan, fragment, params, new_base)
        else:
            current = [
                c.detach().to("cpu", torch.float32) for c in gather(self.plan, fragment, params)
            ]
            if self.rule == "blend":
                kept = [
                    c.mul(self.blend).add_(v, alpha=1.0 - self.blend)
                    for c, v in zip(current, new_base, strict=True)
                ]
            else:  # carry: the progress since the syncer's copy, on the merged values
                since = self.snapshots[fragment] or expected
                kept = [c.sub(s).add_(v) for c, s, v in zip(current, since, new_base, strict=True)]
                snap_steps, snap_tokens = self.snapshot_counters[fragment]
                steps = self.c_steps[fragment] - snap_steps
                tokens = self.c_tokens[fragment] - snap_tokens
            scatter(self.plan, fragment, params, kept)
        self.bases[fragment] = new_base
        self.versions[fragment] = version
        self.c_steps[fragment] = steps
        self.c_tokens[fragment] = tokens
        self.snapshots[fragment] = None
        self.snapshot_counters[fragment] = (0, 0)
        return True

    def state_dict(self, copy: bool = True) -> dict[str, object]:
        """What a newcomer copies from this learner (besides parameters and optimizer state);
        ``copy=False``: the bases themselves, for a caller done with them before they change."""
        return {
            "versions": list(self.versions),
            "bases": [[t.clone() if copy else t for t in frag] for frag in self.bases],
            "step": self.step,
        }

    def load_peer_state(
        self, state: Mapping[str, object], params: Mapping[str, torch.Tensor]
    ) -> None:
        """A newcomer adopts a healthy peer's versions and step, with ``params`` the values it
        copied from that peer. Its bases are those copied values, not the peer's bases, and
        its counters start at zero: the progress the peer made since its bases (answered or
        not, merged or not) is the peer's to push, in direction as in tokens. A newcomer's
        delta against the peer's bases would carry that progress a second time, into a round
        other than the peer's (docs/decisions.md 8). Also the path of a learner resuming its
        own checkpoint: what it trained since that checkpoint's bases is not pushed again."""
        self._adopt(state)
        with torch.no_grad():
            self.bases = [
                [t.detach().to("cpu", torch.float32, copy=True) for t in frag]
                for frag in (gather(self.plan, f, params) for f in range(self.plan.num_fragments))
            ]

    def load_state(self, state: Mapping[str, object]) -> None:
        """Become an exact copy of ``state`` (bases included): the other ranks of a learner
        adopting rank 0's state, which must stay identical to it, not a newcomer's."""
        self._adopt(state)
        bases = state["bases"]
        assert isinstance(bases, list)
        require(len(bases) == self.plan.num_fragments, "bases", len(bases), "wrong length")
        self.bases = [[t.clone() for t in frag] for frag in bases]

    def _adopt(self, state: Mapping[str, object]) -> None:
        versions = state["versions"]
        assert isinstance(versions, list)
        require(len(versions) == self.plan.num_fragments, "versions", versions, "wrong length")
        self.versions = [int(v) for v in versions]
        step = state["step"]
        assert isinstance(step, int)
        self.step = step
        p = self.plan.num_fragments
        self.c_steps = [0] * p
        self.c_tokens = [0] * p
        self.snapshot_counters = [(0, 0)] * p
        self.snapshots = [None] * p

    def _check(self, fragment: int) -> None:
        require(0 <= fragment < self.plan.num_fragments, "fragment", fragment, "out of range")
