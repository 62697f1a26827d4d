"""The token ledger: every token a learner trains on ends merged or wasted with a reason.

A step's tokens move every fragment, so the ledger counts fragment-tokens: per (learner,
fragment) the tokens trained since the learner's base, the part of them already reserved by
an answer in flight, and the outcome of each answer. The totals balance per fragment:
``trained == merged + sum(wasted) + pending``, and tokens are reported as fragment-tokens / P,
so ``tokens_merged`` reads as "tokens whose effect reached the global model".
This is how goodput is computed honestly; it is pure bookkeeping, no tensors, no I/O.

Under the ``carry`` apply rule (core/learner_state.py) a rebase loses nothing: the tokens
trained since the learner's last answer stay pending on the new base, to ride with its next
answer, and are also tallied in ``carried`` (a tally, not an outcome: the balance ignores it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ddiloco.errors import ConfigError, require

# Reasons a token can be wasted. Runtimes may add their own (a string), but these are the
# ones the core and both runtimes produce.
STALE = "stale"  # answer dropped: base older than max_staleness
BASE_ALREADY_MERGED = "base_already_merged"  # answer would re-apply merged progress
INVALID = "invalid"  # answer refused: impossible round or base
OVERWRITTEN = "overwritten"  # progress replaced by a merged fragment before it was pushed
CRASH = "crash"  # trained, not yet pushed, when the learner died
LEFT = "left"  # trained, not yet pushed, when the learner left (scavenged compute)
LOST_IN_FLIGHT = "lost_in_flight"  # pushed but never arrived (learner or link died mid-push)
UNSYNCED_AT_END = "unsynced_at_end"  # still in the learner when the run ended
IN_FLIGHT_AT_END = "in_flight_at_end"  # pushed, not merged, when the run ended
OUTLIER = "outlier"  # answer refused: its delta's norm is out of bounds (core/robust.py)
INCOMPLETE = "incomplete"  # a sharded learner's answer dropped: a rank's part never came


@dataclass
class _Answer:
    learner: int
    fragment: int
    tokens: int  # fragment-tokens this answer carries beyond earlier answers on the same base
    credit_tokens: int = 0  # tokens since base the ledger had counted when it was recorded
    credit_steps: int = 0  # ... and steps (0: unknown): they bound the answer's merge weight


class SyncerLedger(Protocol):
    """What :class:`~ddiloco.core.syncer_state.SyncerState` calls on its ledger: the syncer
    side only. :class:`TokenLedger` and :class:`~ddiloco.core.restart_ledger.RestartLedger`
    both provide it."""

    def credit(self, key: object) -> tuple[int, int] | None: ...
    def since_base(self, learner: int, fragment: int) -> tuple[int, int]: ...
    def merged_answer(self, key: object, weight: float) -> None: ...
    def wasted_answer(self, key: object, reason: str) -> None: ...
    def superseded(self, old: object, new: object) -> None: ...


class TokenLedger:
    """Fragment-token accounting for one run."""

    def __init__(self, num_fragments: int, *, carry: bool = False) -> None:
        require(num_fragments >= 1, "num_fragments", num_fragments, "must be >= 1")
        self.num_fragments = num_fragments
        self.carry = carry  # the learners apply merged fragments by the carry rule
        self._since_base: dict[tuple[int, int], int] = defaultdict(int)
        self._reserved: dict[tuple[int, int], int] = defaultdict(int)
        self._steps_since: dict[tuple[int, int], int] = defaultdict(int)
        self._reserved_steps: dict[tuple[int, int], int] = defaultdict(int)
        self._answers: dict[object, _Answer] = {}
        self.trained_tokens = 0
        self.trained_by_learner: dict[int, int] = defaultdict(int)
        self.merged = [0] * num_fragments
        self.merged_weight = 0.0
        self.wasted: dict[str, list[int]] = {}
        self.carried = [0] * num_fragments  # fragment-tokens kept across a rebase (carry)

    # -- learner side -----------------------------------------------------------------------
    def trained(self, learner: int, tokens: int) -> None:
        """The learner finished a step on ``tokens`` tokens."""
        self.trained_steps(learner, tokens, 1)

    def trained_steps(self, learner: int, tokens: int, steps: int) -> None:
        """The learner finished ``steps`` steps on ``tokens`` tokens (a report covering
        several). The steps bound the tokens-per-step rate a merge weight may claim."""
        require(tokens >= 0, "tokens", tokens, "must be >= 0")
        require(steps >= 0, "steps", steps, "must be >= 0")
        self.trained_tokens += tokens
        self.trained_by_learner[learner] += tokens
        for p in range(self.num_fragments):
            self._since_base[(learner, p)] += tokens
            self._steps_since[(learner, p)] += steps

    def answered(self, learner: int, fragment: int, key: object, c_tokens: int) -> int:
        """The learner snapshotted ``fragment`` with ``c_tokens`` tokens since its base.
        Returns the tokens this answer adds beyond earlier answers on the same base."""
        self._check_fragment(fragment)
        since = self._since_base[(learner, fragment)]
        if not 0 <= c_tokens <= since:
            raise ConfigError("c_tokens", c_tokens, f"learner {learner} trained {since} since base")
        if key in self._answers:
            raise ConfigError("key", key, "answer already recorded")
        new = c_tokens - self._reserved[(learner, fragment)]
        require(new >= 0, "c_tokens", c_tokens, "lower than an earlier answer on the same base")
        self._reserved[(learner, fragment)] = c_tokens
        steps = self._steps_since[(learner, fragment)]
        self._reserved_steps[(learner, fragment)] = steps
        self._answers[key] = _Answer(learner, fragment, new, since, steps)
        return new

    def rebased(self, learner: int, fragment: int) -> None:
        """A merged fragment reached the learner's copy: its unpushed progress is lost
        (overwrite, blend), or carried onto the new base with its steps (carry)."""
        self._check_fragment(fragment)
        cell = (learner, fragment)
        unpushed = self._since_base[cell] - self._reserved[cell]
        steps = self._steps_since[cell] - self._reserved_steps[cell]
        if self.carry:
            self.carried[fragment] += unpushed
        else:
            self._waste(OVERWRITTEN, fragment, unpushed)
            unpushed = steps = 0
        self._since_base[cell] = unpushed
        self._steps_since[cell] = steps
        self._reserved[cell] = 0
        self._reserved_steps[cell] = 0

    def crashed(self, learner: int, reason: str = CRASH) -> None:
        """The learner died (or left): everything not yet pushed is lost for ``reason``;
        its answers already in flight stay open."""
        for p in range(self.num_fragments):
            self._waste(reason, p, self._since_base[(learner, p)] - self._reserved[(learner, p)])
            self._since_base[(learner, p)] = 0
            self._reserved[(learner, p)] = 0
            self._steps_since[(learner, p)] = 0
            self._reserved_steps[(learner, p)] = 0

    # -- syncer side ------------------------------------------------------------------------
    def merged_answer(self, key: object, weight: float) -> None:
        """The answer was merged with ``weight``."""
        answer = self._answers.pop(self._known(key))
        self.merged[answer.fragment] += answer.tokens
        self.merged_weight += weight

    def wasted_answer(self, key: object, reason: str) -> None:
        """The answer was dropped (or lost) for ``reason``."""
        answer = self._answers.pop(self._known(key))
        self._waste(reason, answer.fragment, answer.tokens)

    def superseded(self, old: object, new: object) -> None:
        """A newer answer on the same base replaced ``old``: its tokens ride with ``new``."""
        answer = self._answers.pop(self._known(old))
        self._answers[self._known(new)].tokens += answer.tokens

    def close(self) -> None:
        """End of run: whatever is still in learners or in flight is wasted, with its reason."""
        for key in list(self._answers):
            self.wasted_answer(key, IN_FLIGHT_AT_END)
        for (learner, p), since in list(self._since_base.items()):
            self._waste(UNSYNCED_AT_END, p, since - self._reserved[(learner, p)])
            self._since_base[(learner, p)] = 0
            self._reserved[(learner, p)] = 0
            self._steps_since[(learner, p)] = 0
            self._reserved_steps[(learner, p)] = 0

    # -- plain-data state (a restarted syncer's durable record) -------------------------------
    def to_state(self) -> dict[str, Any]:
        """Everything this ledger knows, as plain values (ints, floats, strings, lists and
        string-keyed dicts), so any serializer (msgpack, JSON) can keep it. Answer keys must
        be ints, strings or tuples of them; tuples become lists."""
        state: dict[str, Any] = {
            "num_fragments": self.num_fragments,
            "trained_tokens": self.trained_tokens,
            "trained_by_learner": [[m, t] for m, t in sorted(self.trained_by_learner.items())],
            "since_base": _cells(self._since_base),
            "reserved": _cells(self._reserved),
            "steps_since_base": _cells(self._steps_since),
            "answers": [
                [_plain_key(k), a.learner, a.fragment, a.tokens, a.credit_tokens, a.credit_steps]
                for k, a in self._answers.items()
            ],
            "merged": list(self.merged),
            "merged_weight": self.merged_weight,
            "wasted": {reason: list(v) for reason, v in sorted(self.wasted.items())},
        }
        if self.carry:  # (only then: an overwrite run's state is what older stores hold)
            state["carry"] = True
            state["carried"] = list(self.carried)
            state["reserved_steps"] = _cells(self._reserved_steps)
        return state

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Replace this ledger's content by ``state`` (from :meth:`to_state`); the state must
        be for the same number of fragments and balanced, or ConfigError is raised."""
        p = self.num_fragments
        require(
            state.get("num_fragments") == p,
            "ledger.num_fragments",
            state.get("num_fragments"),
            f"this run has {p} fragments",
        )
        try:
            merged = [_count(v) for v in state["merged"]]
            wasted = {str(r): [_count(v) for v in vals] for r, vals in state["wasted"].items()}
            since = _uncells(state["since_base"], p)
            reserved = _uncells(state["reserved"], p)
            steps = _uncells(state.get("steps_since_base", []), p)  # (absent in older states)
            reserved_steps = _uncells(state.get("reserved_steps", []), p)
            carried = [_count(v) for v in state.get("carried", [0] * p)]
            carry = state.get("carry", False)
            answers = {_tuple_key(row[0]): _answer(row, p) for row in state["answers"]}
            by_learner = {int(m): _count(t) for m, t in state["trained_by_learner"]}
            trained = _count(state["trained_tokens"])
            weight = float(state["merged_weight"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError("ledger", type(exc).__name__, f"malformed state: {exc}") from None
        require(
            carry == self.carry,
            "ledger.carry",
            carry,
            f"this run's learners {'carry' if self.carry else 'do not carry'} progress",
        )
        require(
            len(merged) == p and len(carried) == p and all(len(v) == p for v in wasted.values()),
            "ledger",
            "lengths",
            f"need {p} values per fragment",
        )
        self.trained_tokens = trained
        self.trained_by_learner = defaultdict(int, by_learner)
        self._since_base = defaultdict(int, since)
        self._reserved = defaultdict(int, reserved)
        self._steps_since = defaultdict(int, steps)
        self._reserved_steps = defaultdict(int, reserved_steps)
        self.carried = carried
        self._answers = answers
        self.merged = merged
        self.merged_weight = weight
        self.wasted = wasted
        require(self.balanced(), "ledger", "state", "does not balance")

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> TokenLedger:
        ledger = cls(int(state["num_fragments"]), carry=bool(state.get("carry", False)))
        ledger.load_state(state)
        return ledger

    # -- totals -----------------------------------------------------------------------------
    def counters(self, learner: int, fragment: int) -> tuple[int, int]:
        """(fragment-tokens trained since the learner's base, the part reserved by answers)."""
        return self._since_base.get((learner, fragment), 0), self._reserved.get(
            (learner, fragment), 0
        )

    def since_base(self, learner: int, fragment: int) -> tuple[int, int]:
        """(fragment-tokens, steps) credited to the learner since its base on ``fragment``."""
        cell = (learner, fragment)
        return self._since_base.get(cell, 0), self._steps_since.get(cell, 0)

    def credit(self, key: object) -> tuple[int, int] | None:
        """(tokens, steps) since base the ledger vouched for when the open answer ``key`` was
        recorded, which bound its merge weight; None if the ledger holds no such answer (it
        refused the answer's counters, or never saw it)."""
        answer = self._answers.get(key)
        return None if answer is None else (answer.credit_tokens, answer.credit_steps)

    def is_open(self, key: object) -> bool:
        """True while the answer ``key`` is recorded and neither merged nor wasted."""
        return key in self._answers

    def pending(self) -> list[int]:
        """Per fragment: fragment-tokens not yet merged or wasted."""
        out = [0] * self.num_fragments
        for (learner, p), since in self._since_base.items():
            out[p] += since - self._reserved.get((learner, p), 0)
        for answer in self._answers.values():
            out[answer.fragment] += answer.tokens
        return out

    def balanced(self) -> bool:
        """True when, for every fragment, trained == merged + wasted + pending."""
        pending = self.pending()
        for p in range(self.num_fragments):
            wasted = sum(per_fragment[p] for per_fragment in self.wasted.values())
            if self.trained_tokens != self.merged[p] + wasted + pending[p]:
                return False
        return True

    def summary(self) -> dict[str, object]:
        """Tokens (fragment-tokens / P) merged, wasted by reason and pending."""
        scale = 1.0 / self.num_fragments
        return {
            "tokens": self.trained_tokens,
            "tokens_merged": sum(self.merged) * scale,
            "tokens_wasted": {r: sum(v) * scale for r, v in sorted(self.wasted.items())},
            "tokens_pending": sum(self.pending()) * scale,
            "tokens_carried": sum(self.carried) * scale,
            "merged_weight": self.merged_weight,
            "balanced": self.balanced(),
        }

    def _waste(self, reason: str, fragment: int, tokens: int) -> None:
        if tokens:
            self.wasted.setdefault(reason, [0] * self.num_fragments)[fragment] += tokens

    def _known(self, key: object) -> object:
        if key not in self._answers:
            raise ConfigError("key", key, "no such answer in flight")
        return key

    def _check_fragment(self, fragment: int) -> None:
        require(0 <= fragment < self.num_fragments, "fragment", fragment, "out of range")


def _plain_key(key: object) -> Any:
    if isinstance(key, tuple):
        return [_plain_key(k) for k in key]
    if isinstance(key, (int, str)) and not isinstance(key, bool):
        return key
    raise ConfigError("key", key, "only ints, strings and tuples of them have a plain state")


def _tuple_key(value: Any) -> object:
    if isinstance(value, list):
        return tuple(_tuple_key(v) for v in value)
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        return value
    raise ValueError(f"answer key {value!r}")


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"token count {value!r}")
    return value


def _answer(row: Any, num_fragments: int) -> _Answer:
    """An open answer's row: key, learner, fragment, tokens[, credit tokens, credit steps]. A
    row from before credits were kept vouches for its own new tokens only, steps unknown."""
    if len(row) == 4:
        _, m, f, t = row
        return _Answer(int(m), _fragment(f, num_fragments), _count(t), _count(t), 0)
    _, m, f, t, ct, cs = row
    return _Answer(int(m), _fragment(f, num_fragments), _count(t), _count(ct), _count(cs))


def _fragment(value: Any, num_fragments: int) -> int:
    if not isinstance(value, int) or not 0 <= value < num_fragments:
        raise ValueError(f"fragment {value!r}")
    return value


def _cells(table: Mapping[tuple[int, int], int]) -> list[list[int]]:
    return [[m, p, v] for (m, p), v in sorted(table.items()) if v]


def _uncells(rows: Any, num_fragments: int) -> dict[tuple[int, int], int]:
    return {(int(m), _fragment(p, num_fragments)): _count(v) for m, p, v in rows}
