"""The adaptive grace window and the running estimates it is computed from.

After the quorum is met, the syncer may wait a little for more answers, but only inside the
slack that overlap leaves: answers must be merged and broadcast before learners run tau steps
past their snapshot. ``slack = tau * xi_step - (xi_quorum + xi_sync)``,
``grace = clamp(gamma * slack, 0, cap_steps * xi_step)``; with no sync estimate yet, the cap.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddiloco.errors import require


@dataclass(frozen=True)
class GraceConfig:
    """Grace-window settings (docs/design.md §3.5: gamma 0.5, cap one step)."""

    enabled: bool = True
    gamma: float = 0.5
    cap_steps: float = 1.0
    smoothing: float = 0.8  # EMA weight of the old estimate

    def __post_init__(self) -> None:
        require(0.0 <= self.gamma < 1.0, "grace.gamma", self.gamma, "must be in [0, 1)")
        require(self.cap_steps >= 0.0, "grace.cap_steps", self.cap_steps, "must be >= 0")
        require(0.0 <= self.smoothing < 1.0, "grace.smoothing", self.smoothing, "must be in [0, 1)")


class Ema:
    """Exponential moving average that is ``None`` until its first sample."""

    def __init__(self, smoothing: float) -> None:
        self.smoothing = smoothing
        self.value: float | None = None

    def update(self, sample: float) -> float:
        require(sample >= 0.0, "sample", sample, "durations must be >= 0")
        if self.value is None:
            self.value = float(sample)
        else:
            self.value = self.smoothing * self.value + (1.0 - self.smoothing) * float(sample)
        return self.value


def grace_window(
    config: GraceConfig,
    *,
    overlap: int,
    step_seconds: float | None,
    quorum_seconds: float,
    sync_seconds: float | None,
) -> float:
    """Seconds to keep a round open after its quorum. Never negative, never above the cap.

    Without a step-time estimate the cap itself is unknown, so there is no grace (0).
    """
    if not config.enabled or step_seconds is None:
        return 0.0
    cap = config.cap_steps * step_seconds
    if sync_seconds is None:
        return cap
    slack = overlap * step_seconds - (quorum_seconds + sync_seconds)
    return min(max(config.gamma * slack, 0.0), cap)
