"""The fragment-sync algorithm's configuration (``[sync]``), nested the way the core is built:
``[sync.rounds]`` is the core's round policy (quorum, staleness, overlap, grace),
``[sync.outer]`` its outer optimizer, ``[sync.robust]`` its robust merging and
``[sync.codec]`` the wire codecs. Each table builds its core config; the baselines' own knobs
live in their method's table (``[diloco]``, ``[streaming]``). The flat keys of earlier versions
(``sync.quorum``, ``sync.outer_lr``, ``sync.mean_outer_lr``...) still load: :func:`move_flat_keys`
puts each where it belongs now, and refuses a key given both ways (docs/design.md §9).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ddiloco.core.codec import CodecSpec
from ddiloco.core.grace import GraceConfig
from ddiloco.core.learner_state import APPLY_RULES
from ddiloco.core.outer import OuterConfig
from ddiloco.core.plans import PARTITIONS, FragmentPlan, build_plan, tensor_specs
from ddiloco.core.robust import RobustConfig
from ddiloco.core.rounds import RoundConfig
from ddiloco.core.syncer_state import SyncerConfig
from ddiloco.errors import ConfigError, require


@dataclass(frozen=True)
class RoundsConfig:
    """``[sync.rounds]``: when a round may close (core/rounds.py, core/grace.py)."""

    quorum: int = 1  # K
    max_staleness: int = 1
    overlap: int = 2  # tau
    grace: bool = True
    grace_gamma: float = 0.5
    grace_cap_steps: float = 1.0
    stale_weight: float = 1.0  # lambda: a late answer weighs 1 / (1 + lambda x staleness)
    anchor: str = "base"  # "current": a late delta re-taken against the current value

    def __post_init__(self) -> None:
        self.core()

    def core(self) -> RoundConfig:
        grace = GraceConfig(self.grace, self.grace_gamma, self.grace_cap_steps)
        return RoundConfig(
            self.quorum, self.max_staleness, self.overlap, grace, self.stale_weight, self.anchor
        )


@dataclass(frozen=True)
class OuterStepConfig:
    """``[sync.outer]``: Decoupled's outer step (core/outer.py). The default is the paper's
    Nesterov (lr 0.5, momentum 0.9) with its momentum ramped up over the first 30 outer steps
    of each fragment (decision 116; the merged delta as it is, decision 83, is lr 1.0,
    momentum 0.0)."""

    optimizer: str = "nesterov"  # nesterov, sgd, delayed_nesterov
    lr: float = 0.5
    momentum: float = 0.9
    delay: int = 1  # delayed_nesterov: momentum refreshed every this many outer steps
    follows_schedule: bool = True  # momentum in units of the inner lr (core/outer.py)
    warmup: int = 30  # nesterov: momentum ramps from 0 over this many outer steps a fragment
    warmup_lr: bool = False  # ... and the rate from 1 (the merged delta as it is) to lr

    def __post_init__(self) -> None:
        self.core()

    def core(self) -> OuterConfig:
        return OuterConfig(
            self.optimizer,
            self.lr,
            self.momentum,
            self.delay,
            warmup=self.warmup,
            warmup_lr=self.warmup_lr,
        )


@dataclass(frozen=True)
class RobustMergeConfig:
    """``[sync.robust]``: weights from the ledger's credit, bounded norms (docs/security.md)."""

    enabled: bool = True
    norm_clip: float = 4.0  # clip an answer to this x the median pace (norm/sqrt(steps))
    norm_refuse: float = 32.0  # refuse one faster than this x that median
    norm_window: int = 32  # recent merged paces per fragment the median is taken over
    norm_warmup: int = 3  # samples before the median judges (the absurd bound holds always)
    norm_absurd: float = 4.0  # refuse an answer longer than this x ||Theta_p||

    def __post_init__(self) -> None:
        self.core()

    def core(self) -> RobustConfig:
        return RobustConfig(
            self.enabled,
            self.norm_clip,
            self.norm_refuse,
            self.norm_window,
            self.norm_warmup,
            self.norm_absurd,
        )


@dataclass(frozen=True)
class CodecConfig:
    """``[sync.codec]``: how fragments travel (core/codec.py)."""

    answers: str = "bf16"  # learner -> syncer
    broadcast: str = "bf16"  # syncer -> learners
    block: int = 128  # block size of the int codecs

    def __post_init__(self) -> None:
        self.answers_spec()
        self.broadcast_spec()

    def answers_spec(self) -> CodecSpec:
        return CodecSpec(self.answers, self.block)

    def broadcast_spec(self) -> CodecSpec:
        return CodecSpec(self.broadcast, self.block)


@dataclass(frozen=True)
class SyncConfig:
    """``[sync]``: the Decoupled DiLoCo algorithm's knobs (docs/design.md §3, defaults §9)."""

    fragments: int = 12  # P
    sync_every: int = 12  # H
    partition: str = "balanced"  # how parameters split into fragments
    split_rows: bool = True
    apply: str = "overwrite"  # how a merged fragment meets local progress (core/learner_state.py)
    blend: float = 0.5  # alpha of apply = "blend"
    merge_rule: str = "rda"
    rounds: RoundsConfig = field(default_factory=RoundsConfig)
    outer: OuterStepConfig = field(default_factory=OuterStepConfig)
    robust: RobustMergeConfig = field(default_factory=RobustMergeConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)

    def __post_init__(self) -> None:
        require(
            self.partition in PARTITIONS, "sync.partition", self.partition, f"known: {PARTITIONS}"
        )
        require(self.apply in APPLY_RULES, "sync.apply", self.apply, f"known: {APPLY_RULES}")
        require(0.0 < self.blend < 1.0, "sync.blend", self.blend, "must be in (0, 1)")
        require(  # (a blend set before sync.apply existed would otherwise be ignored)
            self.apply == "blend" or self.blend == SyncConfig.blend,
            "sync.blend",
            self.blend,
            f"is used only by sync.apply = 'blend' (sync.apply is {self.apply!r})",
        )
        self.syncer_config()

    def fragment_plan(self, model: torch.nn.Module) -> FragmentPlan:
        """The plan both runtimes use for ``model`` (rows split only in balanced plans)."""
        return build_plan(
            tensor_specs(model),
            self.fragments,
            self.partition,
            sync_every=self.sync_every,
            split_rows=self.split_rows and self.partition == "balanced",
        )

    def syncer_config(self) -> SyncerConfig:
        return SyncerConfig(
            self.rounds.core(), self.merge_rule, self.outer.core(), self.robust.core()
        )

    def replace_rounds(self, **changes: Any) -> SyncConfig:
        """This config with ``[sync.rounds]`` changed (the baselines' K = M, no grace)."""
        return dataclasses.replace(self, rounds=dataclasses.replace(self.rounds, **changes))


@dataclass(frozen=True)
class MeanStepConfig:
    """A plain-mean baseline's outer step: Nesterov as DiLoCo publishes it
    (docs/design.md §3.9)."""

    TABLE: ClassVar[str] = ""
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    def __post_init__(self) -> None:
        t = self.TABLE
        require(self.outer_lr > 0.0, f"{t}.outer_lr", self.outer_lr, "must be > 0")
        require(
            0.0 <= self.outer_momentum < 1.0,
            f"{t}.outer_momentum",
            self.outer_momentum,
            "must be in [0, 1)",
        )


@dataclass(frozen=True)
class DiLoCoConfig(MeanStepConfig):
    """``[diloco]``: the DiLoCo baseline (methods/diloco.py)."""

    TABLE: ClassVar[str] = "diloco"
    inner_steps: int = 12  # its H: the whole model every this many steps

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.inner_steps >= 1, "diloco.inner_steps", self.inner_steps, "must be >= 1")


@dataclass(frozen=True)
class StreamingConfig(MeanStepConfig):
    """``[streaming]``: the Streaming DiLoCo baseline (methods/streaming.py)."""

    TABLE: ClassVar[str] = "streaming"


# the flat keys of earlier versions -> where each lives now (a key may feed two tables)
FLAT_KEYS: dict[str, tuple[str, ...]] = {
    **{
        f"sync.{k}": (f"sync.rounds.{k}",)
        for k in ("quorum", "max_staleness", "overlap", "grace", "grace_gamma", "grace_cap_steps")
    },
    **{
        f"sync.outer_{k}": (f"sync.outer.{k}",)
        for k in ("lr", "momentum", "optimizer", "delay", "follows_schedule")
    },
    "sync.robust": ("sync.robust.enabled",),  # (when a bool: the table has the same name)
    **{
        f"sync.norm_{k}": (f"sync.robust.norm_{k}",)
        for k in ("clip", "refuse", "window", "warmup", "absurd")
    },
    "sync.codec": ("sync.codec.answers",),  # (when a string)
    "sync.broadcast_codec": ("sync.codec.broadcast",),
    "sync.codec_block": ("sync.codec.block",),
    "sync.mean_outer_lr": ("diloco.outer_lr", "streaming.outer_lr"),
    "sync.mean_outer_momentum": ("diloco.outer_momentum", "streaming.outer_momentum"),
    "sync.diloco_inner_steps": ("diloco.inner_steps",),
}


def move_flat_keys(data: dict[str, Any], moved: dict[str, str] | None = None) -> dict[str, Any]:
    """A raw config (TOML and overrides) with the earlier versions' flat keys moved to their
    tables; a key given both ways is refused, naming both. ``moved`` collects new key -> the
    old name it was given as (an error about the value can then name what the user wrote)."""
    sync = data.get("sync")
    if not isinstance(sync, dict):
        return data
    for old, news in FLAT_KEYS.items():
        name = old.removeprefix("sync.")
        if name not in sync or isinstance(sync[name], dict):
            continue  # absent, or already the table of that name
        value = sync.pop(name)
        for new in news:
            *tables, key = new.split(".")
            node = data
            for table in tables:
                node = node.setdefault(table, {})
                if not isinstance(node, dict):
                    raise ConfigError(".".join(tables), node, "expected a table")
            if key in node:
                raise ConfigError(old, value, f"given twice: as {old} and as {new} (its name now)")
            node[key] = value
            if moved is not None:
                moved[new] = old
    return data
