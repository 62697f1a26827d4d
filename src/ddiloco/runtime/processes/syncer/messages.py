"""What each learner -> syncer message's metadata must hold, checked before a handler runs.

A frame that passed the wire's checks was signed by a holder of the run secret; that proves
who sent it, not that it is sane (a buggy or hostile learner signs whatever it likes). Every
field is checked here for type and range, so a handler only ever sees plain ints, finite
floats and lists of the right length, and a malformed message is refused with one
:class:`~ddiloco.errors.ConfigError` naming the field (the service counts and logs it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ddiloco.core.rounds import UNSOLICITED, AnswerMeta
from ddiloco.errors import ConfigError
from ddiloco.runtime.processes.syncer.totals import Totals

MAX_COUNT = (1 << 62) - 1  # steps, tokens, versions, ids: far beyond any run, inside int64
MAX_SECONDS = 1e6
MAX_TEXT = 256


def count(meta: dict[str, Any], key: str, low: int = 0, high: int = MAX_COUNT) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"meta.{key}", value, f"expected an integer in [{low}, {high}]")
    return value


def seconds(meta: dict[str, Any], key: str) -> float:
    value = meta.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigError(f"meta.{key}", value, "expected a number of seconds")
    if not (math.isfinite(value) and 0.0 <= value <= MAX_SECONDS):
        raise ConfigError(f"meta.{key}", value, f"expected finite seconds in [0, {MAX_SECONDS}]")
    return float(value)


def counts(meta: dict[str, Any], key: str, length: int | None, high: int = MAX_COUNT) -> list[int]:
    """A list of integers in [0, high]: exactly ``length`` of them, or at most ``high + 1``
    distinct ones when ``length`` is None."""
    value = meta.get(key, [] if length is None else None)
    if not isinstance(value, list):
        raise ConfigError(f"meta.{key}", value, "expected a list of integers")
    if length is not None and len(value) != length:
        raise ConfigError(f"meta.{key}", f"{len(value)} items", f"expected {length}")
    if length is None and len(value) > high + 1:
        raise ConfigError(f"meta.{key}", f"{len(value)} items", f"expected <= {high + 1}")
    return [count({key: v}, key, 0, high) for v in value]


def text(meta: dict[str, Any], key: str) -> str:
    value = meta.get(key, "")
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise ConfigError(f"meta.{key}", value, f"expected a string of <= {MAX_TEXT} chars")
    return value


@dataclass(frozen=True)
class Hello:
    incarnation: int
    step: int
    versions: list[int]
    peer: str  # where this learner serves snapshots to newcomers ("" if it does not)


@dataclass(frozen=True)
class Progress:
    incarnation: int
    step: int
    tokens: int
    seconds: float  # the last step's duration
    rebased: list[int]  # fragments applied since the last report
    totals: Totals | None  # the life's running totals (syncer/totals.py), if it sends them


def hello(meta: dict[str, Any], fragments: int) -> Hello:
    return Hello(
        count(meta, "inc"),
        count(meta, "step"),
        counts(meta, "versions", fragments),
        text(meta, "peer"),
    )


def progress(meta: dict[str, Any], fragments: int) -> Progress:
    rebased = counts(meta, "rebased", None, fragments - 1)
    return Progress(
        count(meta, "inc"),
        count(meta, "step"),
        count(meta, "tokens"),
        seconds(meta, "secs"),
        sorted(set(rebased)),
        totals(meta, fragments),
    )


def totals(meta: dict[str, Any], fragments: int) -> Totals | None:
    """A progress report's or answer's running totals: tokens reported since the life
    started, rebases per fragment (None when it carries neither)."""
    if "total" not in meta and "rebases" not in meta:
        return None
    return count(meta, "total"), counts(meta, "rebases", fragments)


def answer(meta: dict[str, Any], fragments: int) -> AnswerMeta:
    values = {
        name: count(meta, name)
        for name in (
            "learner",
            "incarnation",
            "seq",
            "base_version",
            "local_step",
            "c_steps",
            "c_tokens",
        )
    }
    return AnswerMeta(
        fragment=count(meta, "fragment", 0, fragments - 1),
        round_id=count(meta, "round_id", UNSOLICITED),
        **values,
    )
