"""Late answers: how an answer whose base is older than the fragment it merges into counts.

An answer's delta is ``theta_learner - Theta_base``, taken against the version ``b`` its
learner last received; by the time it merges the fragment is at ``v >= b`` (its staleness
is ``s = v - b``; past ``max_staleness`` the round policy drops it). Two options, off in the
core; the training config turns the weights on (docs/decisions.md 115 says what the data
chose); both pure and replayed exactly by the journal's audit:

- **staleness-aware weights** (``stale_weight`` = lambda > 0): the answer's token weight
  times ``1 / (1 + lambda s)`` (fsb's tokens / (1 + lambda s); CGAD's decreasing function of
  the age). Weights are relative within a round: a round of late answers alone still moves
  the fragment by their typical length (RDA).
- **anchoring on the current value** (``anchor = "current"``): the delta is re-taken against
  ``Theta_v``: ``theta_learner - Theta_v = delta - (Theta_v - Theta_b)``, the updates merged
  since ``b`` subtracted. The syncer keeps the last ``max_staleness`` updates of each
  fragment for that (``max_staleness`` fp32 copies of the model: the option's memory cost).
  After a syncer restart the kept updates are gone; an answer they do not cover is merged
  against its own base, as without the option, and the merge's journal says which were
  anchored, so an audit replays it exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ddiloco.core.merge import tensor_norms, token_weight
from ddiloco.errors import require


def stale_discount(staleness: int, stale_weight: float) -> float:
    """``1 / (1 + stale_weight x staleness)``: 1 for an up-to-date answer or with the option off."""
    require(staleness >= 0, "staleness", staleness, "must be >= 0")
    return 1.0 / (1.0 + stale_weight * staleness)


def answer_weights(
    counters: Sequence[tuple[int, int]], staleness: Sequence[int], stale_weight: float
) -> list[float]:
    """Each answer's merge weight from its (c_tokens, c_steps) and its staleness."""
    return [
        token_weight(tokens, steps) * stale_discount(s, stale_weight)
        for (tokens, steps), s in zip(counters, staleness, strict=True)
    ]


class UpdateHistory:
    """The last ``depth`` updates (``Theta_v - Theta_{v-1}``) of every fragment, to re-anchor a
    late answer on the current value. Call order per merge: :meth:`before` (a copy of the
    fragment), the outer step, :meth:`after` with the new version."""

    def __init__(self, num_fragments: int, depth: int) -> None:
        require(depth >= 0, "depth", depth, "must be >= 0")
        self.depth = depth
        self._updates: list[dict[int, list[torch.Tensor]]] = [{} for _ in range(num_fragments)]

    def before(self, fragment: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        return [t.clone() for t in fragment] if self.depth > 0 else None

    def after(
        self,
        p: int,
        version: int,
        before: list[torch.Tensor] | None,
        fragment: Sequence[torch.Tensor],
    ) -> None:
        """Keep ``fragment - before`` as the update that made ``version`` (in ``before``'s
        memory); forget the ones older than ``depth`` versions."""
        if before is None:
            return
        for old, new in zip(before, fragment, strict=True):
            old.sub_(new).neg_()
        kept = self._updates[p]
        kept[version] = before
        for v in [v for v in kept if v <= version - self.depth]:
            del kept[v]

    def covers(self, p: int, base: int, version: int) -> bool:
        """Whether the updates from ``base`` to ``version`` are all kept."""
        return all(v in self._updates[p] for v in range(base + 1, version + 1))

    def rebase(
        self, p: int, base: int, version: int, delta: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """``delta`` (against ``Theta_base``) re-taken against ``Theta_version``: a new list."""
        out = [d.float().clone() for d in delta]
        for v in range(base + 1, version + 1):
            for o, u in zip(out, self._updates[p][v], strict=True):
                o.sub_(u)
        return out

    def forget(self, p: int) -> None:
        """Fragment ``p`` was put back (a restart): its kept updates are not durable, and
        answers they covered are merged against their own base."""
        self._updates[p].clear()


def anchor_answers(
    history: UpdateHistory,
    p: int,
    version: int,
    bases: Sequence[int],
    deltas: list[Sequence[torch.Tensor]],
    norms: list[list[float]],
    only: Sequence[bool] | None = None,
) -> list[bool]:
    """Re-anchor, in place of ``deltas``/``norms``, each late answer the history covers (or,
    replaying a journal, those ``only`` marks); return which were."""
    anchored = []
    for i, base in enumerate(bases):
        wanted = base < version and (only[i] if only is not None else True)
        ok = wanted and history.covers(p, base, version)
        if ok:
            deltas[i] = history.rebase(p, base, version, deltas[i])
            norms[i] = tensor_norms(deltas[i])
        anchored.append(ok)
    return anchored
