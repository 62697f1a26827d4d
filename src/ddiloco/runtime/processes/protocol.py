"""The learner <-> syncer protocol: one frozen dataclass per message kind, both directions.

The sender builds the message and puts :meth:`Message.meta` on the wire (``transport/wire.py``
signs it and carries the kind in the frame's header); the receiver turns the metadata back
into the same class with :meth:`Message.parse`, which checks every field's type and range. A
frame that passed the wire's checks was signed by a holder of the run secret: that proves who
sent it, not that it is sane (a buggy or hostile peer signs whatever it likes), so a handler
only ever sees plain ints, finite floats and lists of the right length, and a malformed
message is refused with one :class:`~ddiloco.errors.ConfigError` naming the field.

A kind's class, its fields and its checks live here and nowhere else: a key renamed on one
side is renamed on the other (docs/extending.md, "Add a wire message kind"). What travels
beside the metadata stays in the frame's header (the fragment, the round) or its payload (a
fragment's or an answer's tensors).

Learner -> syncer: :class:`Hello`, :class:`Progress`, :class:`Answer`, :class:`AnswerPart`,
:class:`PartHello`, :class:`Beat`, :class:`Inline`, :class:`AskPeers`, :class:`Bye`,
:class:`Proof`.
Syncer -> learner: :class:`Welcome`, :class:`Ask`, :class:`Fragment`, :class:`Verdict`,
:class:`Rehello`, :class:`Beat`, :class:`Peers`, :class:`Stop`, :class:`Leave`, :class:`Kill`,
:class:`Refused`, :class:`NoShm`, :class:`Challenge`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from ddiloco.core.rounds import UNSOLICITED, AnswerMeta
from ddiloco.errors import ConfigError

MAX_COUNT = (1 << 62) - 1  # steps, tokens, versions, ids: far beyond any run, inside int64
MAX_SECONDS = 1e6
MAX_LOSS = 1e4  # nats per token: far above a uniform guess over any vocabulary
MAX_TEXT = 256
MAX_PEERS = 4096
MAX_RANKS = 4096  # ranks of one sharded learner

Totals = tuple[int, list[int]]  # a life's tokens reported and rebases per fragment so far


# -- the field checks ------------------------------------------------------------------------
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


def flag(meta: dict[str, Any], key: str, default: bool) -> bool:
    value = meta.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"meta.{key}", value, "expected true or false")
    return value


def totals(meta: dict[str, Any], fragments: int) -> Totals | None:
    """A progress report's or answer's running totals: tokens reported since the life
    started, rebases per fragment (None when it carries neither)."""
    if "total" not in meta and "rebases" not in meta:
        return None
    return count(meta, "total"), counts(meta, "rebases", fragments)


def loss(meta: dict[str, Any]) -> float | None:
    """An optional train loss: a finite number in [0, MAX_LOSS] (nats per token)."""
    value = meta.get("loss")
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigError("meta.loss", value, "expected a number")
    if not (math.isfinite(value) and 0.0 <= value <= MAX_LOSS):
        raise ConfigError("meta.loss", value, f"expected a finite loss in [0, {MAX_LOSS}]")
    return float(value)


def totals_meta(value: Totals | None) -> dict[str, Any]:
    return {} if value is None else {"total": value[0], "rebases": list(value[1])}


# -- the messages ----------------------------------------------------------------------------
class Message:
    """A message kind: ``KIND`` names it in the frame's header, ``FROM`` says who sends it
    ("learner", "syncer" or both). A kind with no fields has nothing to check."""

    KIND: ClassVar[str]
    FROM: ClassVar[tuple[str, ...]]

    def meta(self) -> dict[str, Any]:
        return {}

    @classmethod
    def parse(cls, meta: dict[str, Any], fragments: int) -> Self:
        """The message ``meta`` holds, every field checked (``fragments``: the run's count,
        the length of per-fragment lists); a malformed field raises ConfigError."""
        return cls()


LEARNER, SYNCER = ("learner",), ("syncer",)


@dataclass(frozen=True)
class Hello(Message):
    """Register this life (again): where it stands, and where it serves peer snapshots."""

    KIND, FROM = "hello", LEARNER
    incarnation: int
    step: int
    versions: list[int]
    peer: str = ""  # where this learner serves snapshots to newcomers ("" if it does not)
    ranks: int = 1  # > 1: a sharded learner; each rank gets its rows of merged fragments

    def meta(self) -> dict[str, Any]:
        meta = {
            "inc": self.incarnation,
            "step": self.step,
            "versions": list(self.versions),
            "peer": self.peer,
        }
        return meta if self.ranks == 1 else {**meta, "ranks": self.ranks}

    @classmethod
    def parse(cls, meta: dict[str, Any], fragments: int) -> Self:
        return cls(
            count(meta, "inc"),
            count(meta, "step"),
            counts(meta, "versions", fragments),
            text(meta, "peer"),
            count(meta, "ranks", 2, MAX_RANKS) if "ranks" in meta else 1,
        )


@dataclass(frozen=True)
class Progress(Message):
    """A progress report: a step trained, its tokens, the fragments rebased since the last."""

    KIND, FROM = "progress", LEARNER
    incarnation: int
    step: int
    tokens: int
    seconds: float  # the last step's duration
    rebased: list[int]  # fragments applied since the last report
    totals: Totals | None = None  # the life's running totals (syncer/totals.py)
    loss: float | None = None  # the step's train loss (a hand-started syncer records it)

    def meta(self) -> dict[str, Any]:
        loss = {} if self.loss is None else {"loss": self.loss}
        return {
            "inc": self.incarnation,
            "step": self.step,
            "tokens": self.tokens,
            "secs": self.seconds,
            "rebased": list(self.rebased),
            **totals_meta(self.totals),
            **loss,
        }

    @classmethod
    def parse(cls, meta: dict[str, Any], fragments: int) -> Self:
        rebased = counts(meta, "rebased", None, fragments - 1)
        return cls(
            count(meta, "inc"),
            count(meta, "step"),
            count(meta, "tokens"),
            seconds(meta, "secs"),
            sorted(set(rebased)),
            totals(meta, fragments),
            loss(meta),
        )


ANSWER_COUNTS = (
    "learner",
    "incarnation",
    "seq",
    "base_version",
    "local_step",
    "c_steps",
    "c_tokens",
)


@dataclass(frozen=True)
class Answer(Message):
    """An answer's metadata (its delta is the payload), with the life's running totals."""

    KIND, FROM = "answer", LEARNER
    answer: AnswerMeta
    totals: Totals | None = None
    ranks: int = 1  # > 1: a sharded learner's rank 0 part (its rows); the others follow

    def meta(self) -> dict[str, Any]:
        ranks = {"ranks": self.ranks} if self.ranks > 1 else {}
        return {**dataclasses.asdict(self.answer), **totals_meta(self.totals), **ranks}

    @classmethod
    def parse(cls, meta: dict[str, Any], fragments: int) -> Self:
        values = {name: count(meta, name) for name in ANSWER_COUNTS}
        answer = AnswerMeta(
            fragment=count(meta, "fragment", 0, fragments - 1),
            round_id=count(meta, "round_id", UNSOLICITED),
            **values,
        )
        ranks = count(meta, "ranks", 2, MAX_RANKS) if "ranks" in meta else 1
        return cls(answer, totals(meta, fragments), ranks)


@dataclass(frozen=True)
class AnswerPart(Message):
    """Rank ``rank`` (>= 1) of a sharded learner's part of answer ``key``: its rows of the
    fragment (the payload), on the rank's own connection (core/parts.py)."""

    KIND, FROM = "answer_part", LEARNER
    key: tuple[int, int, int]
    fragment: int
    rank: int
    ranks: int

    def meta(self) -> dict[str, Any]:
        return {"key": list(self.key), "fragment": self.fragment, "rank": self.rank,
                "ranks": self.ranks}  # fmt: skip

    @classmethod
    def parse(cls, meta: dict[str, Any], fragments: int) -> Self:
        ranks = count(meta, "ranks", 2, MAX_RANKS)
        fragment = count(meta, "fragment", 0, fragments - 1)
        return cls(key_of(meta), fragment, count(meta, "rank", 1, ranks - 1), ranks)


@dataclass(frozen=True)
class PartHello(Message):
    """Rank ``rank`` (>= 1) of a sharded learner on its own link to a syncer life it has not
    spoken to: the fragment versions its learner holds, so the syncer sends this rank its
    rows of every newer merged fragment (the ones it broadcast before this link was routed)."""

    KIND, FROM = "part_hello", LEARNER
    rank: int
    ranks: int
    versions: list[int]

    def meta(self) -> dict[str, Any]:
        return {"rank": self.rank, "ranks": self.ranks, "versions": list(self.versions)}

    @classmethod
    def parse(cls, meta: dict[str, Any], fragments: int) -> Self:
        ranks = count(meta, "ranks", 2, MAX_RANKS)
        return cls(count(meta, "rank", 1, ranks - 1), ranks, counts(meta, "versions", fragments))


@dataclass(frozen=True)
class Beat(Message):
    """Alive, with nothing else to say (both ways); the syncer's says whether it waits for
    this learner (``live``: one it does not wait for says hello again)."""

    KIND, FROM = "beat", LEARNER + SYNCER
    live: bool = True

    def meta(self) -> dict[str, Any]:
        return {"live": self.live}

    @classmethod
    def parse(cls, meta: dict[str, Any], fragments: int) -> Self:
        return cls(flag(meta, "live", True))


@dataclass(frozen=True)
class Inline(Message):
    """The learner cannot read the syncer's /dev/shm slots: send it payloads inline."""

    KIND, FROM = "inline", LEARNER


@dataclass(frozen=True)
class AskPeers(Message):
    """Which live peers serve snapshots (answered with :class:`Peers`)."""

    KIND, FROM = "peers", LEARNER


@dataclass(frozen=True)
class Bye(Message):
    """A clean leave, and why (a SIGTERM, an operator's leave, the learner's time limit)."""

    KIND, FROM = "bye", LEARNER
    why: str = ""

    def meta(self) -> dict[str, Any]:
        return {"why": self.why[:MAX_TEXT]}

    @classmethod
    def parse(cls, meta: dict[str, Any], fragments: int) -> Self:
        return cls(text(meta, "why"))


@dataclass(frozen=True)
class Nonced(Message):
    """A message that carries only a nonce (a connection's challenge, and its proof)."""

    nonce: str

    def meta(self) -> dict[str, Any]:
        return {"nonce": self.nonce}

    @classmethod
    def parse(cls, meta: dict[str, Any], fragments: int) -> Self:
        return cls(text(meta, "nonce"))


@dataclass(frozen=True)
class Proof(Nonced):
    """A new connection's answer to a :class:`Challenge`: it holds the secret now."""

    KIND, FROM = "proof", LEARNER


@dataclass(frozen=True)
class Welcome(Message):
    """Registered: the run's global step and the syncer's fragment versions."""

    KIND, FROM = "welcome", SYNCER
    global_step: int
    versions: list[int]

    def meta(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "versions": list(self.versions)}

    @classmethod
    def parse(cls, meta: dict[str, Any], fragments: int) -> Self:
        return cls(count(meta, "global_step"), counts(meta, "versions", fragments))


@dataclass(frozen=True)
class Ask(Message):
    """Answer the round in the header (``final``: the run's end, stop stepping and answer)."""

    KIND, FROM = "ask", SYNCER
    final: bool = False

    def meta(self) -> dict[str, Any]:
        return {"final": True} if self.final else {}

    @classmethod
    def parse(cls, meta: dict[str, Any], fragments: int) -> Self:
        return cls(flag(meta, "final", False))


@dataclass(frozen=True)
class Fragment(Message):
    """A merged fragment (the payload) at ``version``, with the answer keys it merged."""

    KIND, FROM = "fragment", SYNCER
    version: int
    keys: list[tuple[int, int, int]]

    def meta(self) -> dict[str, Any]:
        return {"version": self.version, "keys": [list(k) for k in self.keys]}

    @classmethod
    def parse(cls, meta: dict[str, Any], fragments: int) -> Self:
        keys = meta.get("keys", [])
        if not isinstance(keys, list) or len(keys) > MAX_PEERS:
            raise ConfigError("meta.keys", keys, f"expected a list of <= {MAX_PEERS} keys")
        return cls(count(meta, "version"), [key_of({"key": k}) for k in keys])


def key_of(meta: dict[str, Any]) -> tuple[int, int, int]:
    """An answer's key: (learner, incarnation, seq)."""
    learner, incarnation, seq = counts(meta, "key", 3)
    return learner, incarnation, seq


@dataclass(frozen=True)
class Verdict(Message):
    """An answer of this learner's was dropped, and why (``core.rounds.Verdict``'s value)."""

    KIND, FROM = "verdict", SYNCER
    key: tuple[int, int, int]
    verdict: str

    def meta(self) -> dict[str, Any]:
        return {"key": list(self.key), "verdict": self.verdict}

    @classmethod
    def parse(cls, meta: dict[str, Any], fragments: int) -> Self:
        return cls(key_of(meta), text(meta, "verdict"))


@dataclass(frozen=True)
class Rehello(Message):
    """This syncer life does not know this learner life: say hello again and re-push."""

    KIND, FROM = "rehello", SYNCER


@dataclass(frozen=True)
class Peers(Message):
    """The answer to :class:`AskPeers`: the live peers' recovery addresses (the furthest
    trained first) and the syncer's fragment versions, the most any honest peer's snapshot
    can hold (None: it did not say)."""

    KIND, FROM = "peers", SYNCER
    addresses: dict[str, str]
    versions: list[int] | None = None

    def meta(self) -> dict[str, Any]:
        versions = {} if self.versions is None else {"versions": list(self.versions)}
        return {"peers": dict(self.addresses), **versions}

    @classmethod
    def parse(cls, meta: dict[str, Any], fragments: int) -> Self:
        addresses = meta.get("peers", {})
        if not isinstance(addresses, dict) or len(addresses) > MAX_PEERS:
            raise ConfigError("meta.peers", addresses, "expected a map of learner -> address")
        checked = {}
        for k, v in addresses.items():
            if not (isinstance(k, str) and k.isdigit() and len(k) <= 9):
                raise ConfigError("meta.peers", k, "expected a learner id")
            checked[k] = text({"peers": v}, "peers")
        versions = counts(meta, "versions", fragments) if "versions" in meta else None
        return cls(checked, versions)


@dataclass(frozen=True)
class Stop(Message):
    """The run is over: nothing more comes, nothing more is said."""

    KIND, FROM = "stop", SYNCER


@dataclass(frozen=True)
class Told(Message):
    """A message that says only why (the operator, the refusal): the learner logs it."""

    why: str = "the syncer"

    def meta(self) -> dict[str, Any]:
        return {"why": self.why[:MAX_TEXT]}

    @classmethod
    def parse(cls, meta: dict[str, Any], fragments: int) -> Self:
        return cls(text(meta, "why") or "the syncer")


@dataclass(frozen=True)
class Leave(Told):
    """An operator's, from the status page: leave cleanly."""

    KIND, FROM = "leave", SYNCER


@dataclass(frozen=True)
class Kill(Told):
    """An operator's, from the status page: crash now, as a real failure would."""

    KIND, FROM = "kill", SYNCER


@dataclass(frozen=True)
class Refused(Told):
    """This learner cannot take part (ahead of the syncer's store, a newer process took its
    slot): it stops, saying why."""

    KIND, FROM = "refused", SYNCER


@dataclass(frozen=True)
class NoShm(Message):
    """The syncer cannot read this learner's /dev/shm slots: send inline."""

    KIND, FROM = "no_shm", SYNCER


@dataclass(frozen=True)
class Challenge(Nonced):
    """Prove this new connection holds the secret now: echo ``nonce`` in a :class:`Proof`."""

    KIND, FROM = "challenge", SYNCER


KINDS: tuple[type[Message], ...] = (
    Hello,
    Progress,
    Answer,
    AnswerPart,
    PartHello,
    Beat,
    Inline,
    AskPeers,
    Bye,
    Proof,
    Welcome,
    Ask,
    Fragment,
    Verdict,
    Rehello,
    Peers,
    Stop,
    Leave,
    Kill,
    Refused,
    NoShm,
    Challenge,
)
FROM_LEARNER: dict[str, type[Message]] = {k.KIND: k for k in KINDS if "learner" in k.FROM}
FROM_SYNCER: dict[str, type[Message]] = {k.KIND: k for k in KINDS if "syncer" in k.FROM}
