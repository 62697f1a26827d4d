"""The one summary schema every runtime writes (``summary.json``, the final table).

Each runtime measures its own quantities (the simulated clock reads its nodes, the syncer
service its ledger and membership, the data-parallel jobs their checkpoints); this module
turns them into the same keys with the same definitions, so ``ddiloco compare`` and the
final table read every run alike:

- ``goodput``: useful compute over allocated compute. Fragment methods: (tokens trained -
  tokens lost to failures) / (tokens trained + tokens the learners could have trained while
  down or waiting), see :func:`fragment_goodput`. Data-parallel: replica-time of the steps
  kept over every replica slot for the whole run (a rolled-back step is not useful).
- ``token_efficiency``: tokens merged (kept) / tokens trained: the algorithm's own share,
  reported apart from goodput so the two effects are not mixed (docs/decisions.md).
- ``uptime``: the share of the run's time during which training could progress (>= K live
  learners for fragment methods; the job stepping for data-parallel).
- ``virtual_seconds``: the run's duration on its clock (``clock``: "virtual" on the
  simulated clock, "wall" on real processes).
- ``eval_bpb``: ``eval_loss`` in bits per byte of text, comparable across tokenizers.
- ``checkpoint``: the method's last checkpoint of the global model, relative to the run
  directory (None when none was written: a run stopped before it).
- ``eval_loss_equal_time``: the eval loss at the first method's finishing time
  (``equal_time_seconds``), linear between evaluations; a method done by then keeps its
  final loss. Equal tokens and equal time tell different stories (a slower method may be
  better per token and worse per second), so the final table shows both.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from ddiloco.core import ledger as reasons

# Waste caused by failures; the rest is the algorithm's own (overlap overwrites, staleness).
FAILURE_REASONS = (reasons.CRASH, reasons.LOST_IN_FLIGHT)

REQUIRED = (
    "method",
    "runtime",
    "clock",
    "eval_loss",
    "eval_bpb",
    "checkpoint",
    "tokens",
    "tokens_merged",
    "tokens_wasted",
    "ledger_balanced",
    "goodput",
    "token_efficiency",
    "uptime",
    "idle_seconds",
    "virtual_seconds",
    "bytes_sent",
    "bytes_received",
    "bytes_per_token",
)


class Uptime:
    """Time during which at least ``quorum`` learners are live. Call :meth:`account` before
    every membership change, with the number live until then."""

    def __init__(self, quorum: int, start: float | None = 0.0) -> None:
        self.quorum = quorum
        self.mark = start  # None: counting starts at the first call (the first hello)
        self.first = start
        self.seconds = 0.0

    def account(self, now: float, live: int) -> None:
        if live >= self.quorum and self.mark is not None:
            self.seconds += now - self.mark
        self.mark = now
        if self.first is None:
            self.first = now

    def share(self, now: float) -> float:
        """The uptime: the share of the time since counting started."""
        elapsed = now - (self.first or 0.0)
        return self.seconds / elapsed if elapsed > 0 else 1.0


def fragment_goodput(tokens: float, wasted: Mapping[str, float], lost_capacity: float) -> float:
    """(trained - lost to failures) / (trained + what the down or waiting learners could
    have trained), in tokens."""
    lost = sum(wasted.get(r, 0.0) for r in FAILURE_REASONS)
    return (tokens - lost) / max(tokens + lost_capacity, 1.0)


def summary(
    *,
    method: str,
    runtime: str,
    eval_loss: float,
    tokens: int,
    tokens_merged: float,
    tokens_wasted: Mapping[str, float],
    goodput: float,
    uptime: float,
    seconds: float,
    bytes_sent: int,
    bytes_received: int,
    ledger_balanced: bool = True,
    idle_seconds: float = 0.0,
    eval_bpb: float | None = None,
    checkpoint: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One method's summary: the schema's keys (:data:`REQUIRED`), then the runtime's own."""
    out: dict[str, Any] = {
        "method": method,
        "runtime": runtime,
        "clock": "virtual" if runtime == "sim" else "wall",
        "eval_loss": eval_loss,
        "eval_bpb": eval_bpb,
        "checkpoint": checkpoint,
        "tokens": tokens,
        "tokens_merged": tokens_merged,
        "tokens_wasted": dict(tokens_wasted),
        "ledger_balanced": ledger_balanced,
        "goodput": goodput,
        "token_efficiency": tokens_merged / max(tokens, 1),
        "uptime": uptime,
        "idle_seconds": idle_seconds,
        "virtual_seconds": seconds,
        "bytes_sent": bytes_sent,
        "bytes_received": bytes_received,
        "bytes_per_token": (bytes_sent + bytes_received) / max(tokens, 1),
    }
    out.update(extra)
    return out


# what a syncer's summary holds under the schema's names, and what the schema computes itself
_SYNCER_SCHEMA_KEYS = (
    "eval_loss",
    "tokens_merged",
    "tokens_wasted",
    "goodput",
    "uptime",
    "bytes_sent",
    "bytes_received",
)
_COMPUTED = ("method", "runtime", "clock", "token_efficiency", "virtual_seconds", "bytes_per_token")


def syncer_summary(
    record: Mapping[str, Any],
    *,
    method: str,
    runtime: str,
    seconds: float,
    idle_seconds: float = 0.0,
    **extra: Any,
) -> dict[str, Any]:
    """A syncer service's summary (its ``summary`` event, or what ``serve`` returns) in the
    schema, with what its supervisor counted (``extra``): how the launchers and a
    hand-started ``ddiloco syncer --out`` write the same summary.json."""
    rest = {k: v for k, v in record.items() if k not in ("kind", "t", *_COMPUTED)}
    rest.pop("idle_seconds", None)
    rest.setdefault("summary_source", "syncer")
    rest.update(extra)
    schema = {k: rest.pop(k) for k in _SYNCER_SCHEMA_KEYS}
    return summary(
        method=method,
        runtime=runtime,
        tokens=int(rest.pop("tokens")),
        seconds=seconds,
        ledger_balanced=bool(rest.pop("ledger_balanced", False)),
        idle_seconds=idle_seconds,
        **schema,
        **rest,
    )


def loss_at(curve: Sequence[tuple[float, float]], t: float) -> float | None:
    """The eval loss at time ``t`` on a curve of (time, loss) evaluations, linear between
    two; the last loss once the curve has ended; None before the first evaluation."""
    if not curve or t < curve[0][0]:
        return None
    for (t0, l0), (t1, l1) in itertools.pairwise(curve):
        if t0 <= t <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (t - t0) / (t1 - t0)
    return curve[-1][1]


def add_equal_time(
    summaries: Sequence[dict[str, Any]], curves: Mapping[str, Sequence[tuple[float, float]]]
) -> None:
    """Give every summary its eval loss at the first method's finishing time (in place)."""
    if not summaries:
        return
    horizon = summaries[0]["virtual_seconds"]
    for s in summaries:
        s["equal_time_seconds"] = horizon
        s["eval_loss_equal_time"] = loss_at(curves.get(s["method"], []), horizon)
