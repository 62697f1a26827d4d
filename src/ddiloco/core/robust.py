"""Robust merging: weigh and bound an answer by what the syncer can check, not what it claims.

An answer says how many tokens and steps it carries (``c_tokens``, ``c_steps``), and those set
its merge weight; its delta sets how far the merge moves. A learner holding the run secret (an
insider, or a buggy learner) could claim 10^12 tokens and take the whole weight, or send a
delta a million times too long. Here is what the syncer uses instead, all pure and
deterministic (no randomness, no clock, no I/O):

* weights from the ledger's credit: the tokens (and steps) the syncer itself counted for the
  learner since its base, never more than the claim (:func:`credited_counters`), and a progress
  report credits at most what the elapsed steps can hold (:func:`credit_progress`);
* a per-fragment bound on each answer's *pace*: its L2 norm over the square root of its steps
  (the steps bounded by the credited ones). An answer's length grows with the steps it
  carries, between sqrt(steps) (noise) and steps (a steady direction): a first round after 1
  step at warm-up learning rates and the next after 12 differ 30x in norm, 10x in pace, and
  within one round honest paces differ less than 3x (docs/security.md). A window keeps the
  paces of recently merged answers, one sample per learner and round; the reference is the
  larger of its lower median and the lower median of the round being merged, so it follows
  the learning-rate schedule without lagging and a liar must be half of the window *and* half
  of the round to pull it. Faster answers are scaled down (clipped) at merge time; absurd
  ones are refused on arrival (:func:`refusal`, :func:`clip_scales`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ddiloco.errors import require

# Why an answer's norm got it refused (each is counted as "outlier_<reason>").
ZERO = "zero"  # exactly zero delta while it claims steps: no honest learner sends that
ABSURD = "absurd"  # longer than norm_absurd x ||Theta_p||: at any time, with or without history
TOO_FAST = "too_fast"  # pace above norm_refuse x the window's median

# A round's own lower median needs this many learners: with one liar among n >= 2 it is at
# most the fastest honest pace (the lower median of two is the smaller).
ROUND_SAMPLES = 2


@dataclass(frozen=True)
class RobustConfig:
    """The syncer's defences against a lying answer (docs/security.md, "Robust merging").

    ``enabled = False`` restores the unchecked merge exactly (claims are weights, no bound).
    """

    enabled: bool = True
    norm_clip: float = 4.0  # scale an answer down to this x the reference pace
    norm_refuse: float = 32.0  # refuse an answer whose pace exceeds this x the window median
    norm_window: int = 32  # merged-answer paces kept per fragment
    norm_warmup: int = 3  # samples before a median judges (before: the absurd bound only)
    norm_absurd: float = 4.0  # refuse an answer longer than this x ||Theta_p||, always

    def __post_init__(self) -> None:
        require(self.norm_clip >= 1.0, "norm_clip", self.norm_clip, "must be >= 1")
        require(
            self.norm_refuse >= self.norm_clip,
            "norm_refuse",
            self.norm_refuse,
            f"must be >= norm_clip ({self.norm_clip})",
        )
        require(math.isfinite(self.norm_refuse), "norm_refuse", self.norm_refuse, "must be finite")
        require(self.norm_window >= 1, "norm_window", self.norm_window, "must be >= 1")
        require(
            1 <= self.norm_warmup <= self.norm_window,
            "norm_warmup",
            self.norm_warmup,
            f"must be in [1, norm_window = {self.norm_window}]",
        )
        require(
            self.norm_absurd > 0.0 and math.isfinite(self.norm_absurd),
            "norm_absurd",
            self.norm_absurd,
            "must be finite and > 0",
        )


# -- weights --------------------------------------------------------------------------------
def credit_progress(
    last_step: int, step: float, tokens: float, tokens_per_step: int, max_steps: float
) -> tuple[int, int]:
    """(steps, tokens) to credit for a progress report claiming ``step`` and ``tokens``.

    The step must advance past ``last_step`` (the step credited so far), by at most
    ``max_steps`` (the caller bounds it by the wall time since the last report over the
    fastest step time); tokens never exceed the credited steps x ``tokens_per_step`` (the
    config's batch_size x seq_len x ranks). A non-finite, negative or fractional claim credits
    nothing. The caller records ``last_step + steps`` as the learner's step (not the claim),
    so a jump to step 10^9 buys no more than ``max_steps``.
    """
    if not (_whole(step) and _whole(last_step) and _finite(tokens) and tokens >= 0):
        return 0, 0
    if math.isnan(max_steps) or max_steps < 1 or tokens_per_step <= 0:
        return 0, 0
    advance = int(step) - int(last_step)
    if advance <= 0:
        return 0, 0
    steps = advance if math.isinf(max_steps) else min(advance, math.floor(max_steps))
    return steps, min(math.floor(tokens), steps * tokens_per_step)


def credited_counters(
    c_tokens: int, c_steps: int, credit_tokens: int, credit_steps: int
) -> tuple[int, int]:
    """An answer's (c_tokens, c_steps) as the merge weighs them, given the ledger's credit.

    Tokens: at most the credited ones. Steps: at least what keeps the tokens-per-step rate at
    or below the credited rate, so ``token_weight`` = tokens x tokens-per-step never exceeds
    what the credited progress is worth (claiming 1 step for 12 steps' tokens would otherwise
    be worth 12x). An honest answer (claim = credit) keeps its counters exactly.
    """
    tokens = max(0, min(c_tokens, credit_tokens))
    steps = c_steps
    if tokens > 0 and credit_tokens > 0 and credit_steps > 0:
        steps = max(c_steps, -(-(tokens * credit_steps) // credit_tokens))  # ceil, in integers
    return tokens, steps


# -- norms ----------------------------------------------------------------------------------
def lower_median(values: Iterable[float]) -> float | None:
    """The lower median (an element, never an average): half the samples must lie to move it
    past every honest one, exactly half included. None for no samples."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else None


class NormWindow:
    """The paces of the last ``size`` merged answers of one fragment (post-clip), one per
    learner and round, so a learner that answers more often weighs no more in the median."""

    def __init__(self, size: int) -> None:
        require(size >= 1, "norm_window", size, "must be >= 1")
        self.values: deque[float] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self.values)

    def add(self, norm: float) -> None:
        self.values.append(float(norm))

    def median(self) -> float | None:
        return lower_median(self.values)

    def load(self, values: Iterable[float]) -> None:
        """Replace the samples (a restarted syncer's durable state); the newest are kept."""
        self.values.clear()
        for v in values:
            require(_finite(v) and v >= 0, "norm_window", v, "norms must be finite and >= 0")
            self.values.append(float(v))


def answer_norm(norms: Sequence[float]) -> float:
    """An answer's L2 norm from its per-tensor norms (``merge.tensor_norms``)."""
    return math.sqrt(sum(n * n for n in norms))


def pace(norm: float, steps: int) -> float:
    """Norm / sqrt(steps): what the window compares (a 0-step answer counts as 1 step)."""
    return norm / math.sqrt(max(1, steps))


def refusal(
    config: RobustConfig,
    norm: float,
    steps: int,
    param_norm: float,
    window: NormWindow,
) -> str | None:
    """Why an arriving answer (L2 norm ``norm``, ``steps`` credited steps) is refused, or None.

    A zero delta that carries steps; one longer than ``norm_absurd`` x the fragment's own norm
    ||Theta_p|| (the one scale a first-round attacker cannot move; skipped for an all-zero
    fragment); once the window holds ``norm_warmup`` samples, one faster than ``norm_refuse``
    x its median.
    """
    if norm == 0.0 and steps > 0:
        return ZERO
    if param_norm > 0.0 and norm > config.norm_absurd * param_norm:
        return ABSURD
    median = window.median() if len(window) >= config.norm_warmup else None
    if median and pace(norm, steps) > config.norm_refuse * median:
        return TOO_FAST
    return None


def clip_scales(
    config: RobustConfig,
    paces: Sequence[float],
    learners: Sequence[int],
    weights: Sequence[float],
    window: NormWindow,
) -> tuple[list[float], list[float]]:
    """Scale factors (<= 1) for one round's answers, and the per-learner paces to add to the
    window afterwards (post-clip, positive-weight answers only, the fastest per learner).

    The reference is the larger of the window's lower median (once it holds ``norm_warmup``
    samples) and the round's (one sample per learner, from ``ROUND_SAMPLES`` learners): the
    round's follows the learning-rate schedule, which the window lags, and bounds a liar in a
    fragment's very first round; the window's holds when a round has one answer, and keeps a
    slow liar from dragging honest answers down. With neither, nothing is clipped (the
    absurd bound still holds).
    """
    per_learner: dict[int, float] = {}
    for v, m, w in zip(paces, learners, weights, strict=True):
        if w > 0.0:
            per_learner[m] = max(per_learner.get(m, 0.0), v)
    reference = 0.0
    if len(window) >= config.norm_warmup:
        reference = window.median() or 0.0
    if len(per_learner) >= ROUND_SAMPLES:
        reference = max(reference, lower_median(per_learner.values()) or 0.0)
    scales = [1.0] * len(paces)
    if reference > 0.0:
        cap = config.norm_clip * reference
        scales = [1.0 if v <= cap else cap / v for v in paces]
    added: dict[int, float] = {}
    for v, m, w, s in zip(paces, learners, weights, scales, strict=True):
        if w > 0.0:
            added[m] = max(added.get(m, 0.0), v * s)
    return scales, [added[m] for m in sorted(added)]


@torch.no_grad()
def scaled(delta: Sequence[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """``delta`` x ``scale`` in new fp32 tensors: the clipped answer the merge uses. A replay of
    the merge record (an audit) calls this with the recorded scale to get the same bits."""
    return [torch.mul(t.float(), scale) for t in delta]


def _finite(x: object) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return True  # (any size: a huge int is finite, and math.isfinite would overflow)
    return isinstance(x, float) and math.isfinite(x)


def _whole(x: object) -> bool:
    """A finite, non-negative, integral number (an int, or a float such as 12.0)."""
    if not _finite(x) or not isinstance(x, (int, float)) or x < 0:
        return False
    return isinstance(x, int) or x.is_integer()
