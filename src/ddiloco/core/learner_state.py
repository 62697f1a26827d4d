"""What a learner knows about synchronization, without any I/O.

The learner trains on its own; this object keeps, per fragment, the base version it last
received (and a copy of those global values, to compute its delta against), the step and
token counters since that base, and the sequence numbers of its answers. Runtimes call
``stepped`` after every training step, ``answer`` when the syncer asks for a fragment (after
the step in progress), and ``apply`` when a merged fragment arrives between two steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ddiloco.core.plans import FragmentPlan, gather, scatter
from ddiloco.core.rounds import AnswerMeta
from ddiloco.errors import ConfigError, require


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
        blend: float = 0.0,
        versions: Sequence[int] | None = None,
    ) -> None:
        require(0.0 <= blend < 1.0, "blend", blend, "alpha must be in [0, 1)")
        self.learner = learner
        self.plan = plan
        self.incarnation = incarnation
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
        return Answer(meta, delta)

    @torch.no_grad()
    def apply(
        self,
        fragment: int,
        version: int,
        values: Sequence[torch.Tensor],
        params: Mapping[str, torch.Tensor],
    ) -> bool:
        """A merged fragment arrived: overwrite (or blend) the parameters, rebase, reset the
        counters. An older version than the one held is ignored (returns False)."""
        self._check(fragment)
        if version <= self.versions[fragment]:
            return False
        expected = self.bases[fragment]
        if len(values) != len(expected) or any(
            v.shape != e.shape for v, e in zip(values, expected, strict=True)
        ):
            raise ConfigError("values", len(values), f"do not match fragment {fragment}'s shapes")
        new_base = [v.detach().to("cpu", torch.float32, copy=True) for v in values]
        if self.blend > 0.0:
            current = gather(self.plan, fragment, params)
            mixed = [
                c.detach().float().mul(self.blend).add_(v, alpha=1.0 - self.blend)
                for c, v in zip(current, new_base, strict=True)
            ]
            scatter(self.plan, fragment, params, mixed)
        else:
            scatter(self.plan, fragment, params, new_base)
        self.bases[fragment] = new_base
        self.versions[fragment] = version
        self.c_steps[fragment] = 0
        self.c_tokens[fragment] = 0
        return True

    def state_dict(self) -> dict[str, object]:
        """What a newcomer copies from this learner (besides parameters and optimizer state)."""
        return {
            "versions": list(self.versions),
            "bases": [[t.clone() for t in frag] for frag in self.bases],
            "step": self.step,
        }

    def load_peer_state(self, state: Mapping[str, object]) -> None:
        """Adopt a healthy peer's bases and step. Counters start at zero: the peer's unpushed
        tokens stay the peer's, so no token is counted twice."""
        versions = state["versions"]
        bases = state["bases"]
        assert isinstance(versions, list) and isinstance(bases, list)
        require(len(versions) == self.plan.num_fragments, "versions", versions, "wrong length")
        self.versions = [int(v) for v in versions]
        self.bases = [[t.clone() for t in frag] for frag in bases]
        step = state["step"]
        assert isinstance(step, int)
        self.step = step
        self.c_steps = [0] * self.plan.num_fragments
        self.c_tokens = [0] * self.plan.num_fragments

    def _check(self, fragment: int) -> None:
        require(0 <= fragment < self.plan.num_fragments, "fragment", fragment, "out of range")
