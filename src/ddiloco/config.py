"""Run configuration: typed dataclasses, loaded from TOML and ``--set key=value`` overrides.

One ``RunConfig`` describes a whole experiment (model, data, training, sync algorithm, the
simulated hardware and network, the chaos plan, the methods to compare). Unknown keys and
wrong types are refused with the dotted key named, so a typo never silently runs defaults.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.chaos.plan import ChaosEvent, ChaosGenerators
from ddiloco.core.codec import CodecSpec
from ddiloco.core.grace import GraceConfig
from ddiloco.core.outer import OuterConfig
from ddiloco.core.plans import STRATEGIES
from ddiloco.core.rounds import RoundConfig
from ddiloco.errors import ConfigError, require

METHODS = ("decoupled", "decoupled_sync", "streaming", "diloco", "data_parallel", "elastic_dp")


@dataclass(frozen=True)
class DataConfig:
    source: str = "shakespeare"  # built-in corpus, or a text file / directory
    eval_fraction: float = 0.05
    eval_batches: int = 8


@dataclass(frozen=True)
class TrainConfig:
    """Each learner's inner training, and the run's budget."""

    learners: int = 4
    scavenged: int = 0  # extra learner slots that start absent and come and go (chaos join)
    batch_size: int = 8  # sequences per learner step
    lr: float = 3e-3  # inner AdamW
    weight_decay: float = 0.1
    warmup_steps: int = 20
    grad_clip: float = 1.0
    tokens: int = 1_500_000  # total tokens trained by all learners together
    eval_every: int = 100_000  # tokens between evaluations of the global model
    max_virtual_seconds: float = 0.0  # also stop at this virtual time (0: tokens only)
    device: str = "cpu"  # learners' device: cpu, cuda, cuda:N; the syncer stays on CPU

    def __post_init__(self) -> None:
        for name in ("learners", "batch_size", "tokens", "eval_every"):
            require(getattr(self, name) >= 1, f"train.{name}", getattr(self, name), "must be >= 1")
        require(self.scavenged >= 0, "train.scavenged", self.scavenged, "must be >= 0")
        require(self.max_virtual_seconds >= 0, "train.max_virtual_seconds",
                self.max_virtual_seconds, "must be >= 0")  # fmt: skip
        require(self.lr > 0, "train.lr", self.lr, "must be > 0")


@dataclass(frozen=True)
class SyncConfig:
    """The Decoupled DiLoCo algorithm's knobs (DESIGN §3)."""

    fragments: int = 12  # P
    sync_every: int = 12  # H
    strategy: str = "balanced"
    split_rows: bool = True
    overlap: int = 2  # tau
    quorum: int = 1  # K
    max_staleness: int = 1
    grace: bool = True
    grace_gamma: float = 0.5
    grace_cap_steps: float = 1.0
    blend: float = 0.0  # alpha
    merge_rule: str = "rda"
    outer_lr: float = 0.5
    outer_momentum: float = 0.9
    mean_outer_lr: float = 0.7  # outer lr of the plain-mean baselines (DESIGN §3.2)
    diloco_inner_steps: int = 12  # H of the DiLoCo baseline
    codec: str = "bf16"  # learner -> syncer
    broadcast_codec: str = "bf16"  # syncer -> learners
    codec_block: int = 128

    def __post_init__(self) -> None:
        require(self.strategy in STRATEGIES, "sync.strategy", self.strategy, f"known: {STRATEGIES}")
        require(0.0 <= self.blend < 1.0, "sync.blend", self.blend, "must be in [0, 1)")
        self.rounds()
        self.outer()
        self.codec_spec()
        self.broadcast_spec()

    def rounds(self) -> RoundConfig:
        grace = GraceConfig(self.grace, self.grace_gamma, self.grace_cap_steps)
        return RoundConfig(self.quorum, self.max_staleness, self.overlap, grace)

    def outer(self) -> OuterConfig:
        return OuterConfig("nesterov", self.outer_lr, self.outer_momentum)

    def codec_spec(self) -> CodecSpec:
        return CodecSpec(self.codec, self.codec_block)

    def broadcast_spec(self) -> CodecSpec:
        return CodecSpec(self.broadcast_codec, self.codec_block)


@dataclass(frozen=True)
class HardwareConfig:
    """Simulated step times: base x per-learner speed factor x (1 + jitter * U[0,1))."""

    step_seconds: float = 1.0
    speed: tuple[float, ...] = ()  # per learner, default 1.0 each; 1.18 = 18% slower
    jitter: float = 0.1

    def __post_init__(self) -> None:
        require(self.step_seconds > 0, "hardware.step_seconds", self.step_seconds, "must be > 0")
        require(all(s > 0 for s in self.speed), "hardware.speed", self.speed, "must be > 0")
        require(self.jitter >= 0, "hardware.jitter", self.jitter, "must be >= 0")


@dataclass(frozen=True)
class NetworkConfig:
    """Simulated links: time = latency + bytes / bandwidth."""

    latency_seconds: float = 0.01
    learner_syncer_gbps: float = 0.05  # per learner link, each way
    learner_learner_gbps: float = 0.1  # for peer recovery
    detect_seconds: float = 2.0  # until the syncer notices a dead learner

    def __post_init__(self) -> None:
        for name in ("learner_syncer_gbps", "learner_learner_gbps"):
            require(getattr(self, name) > 0, f"network.{name}", getattr(self, name), "must be > 0")
        require(self.latency_seconds >= 0, "network.latency_seconds", self.latency_seconds, ">= 0")


@dataclass(frozen=True)
class DPConfig:
    """Data-parallel baselines under failures (simulated seconds)."""

    checkpoint_every: int = 50  # steps between checkpoints (non-elastic restarts from one)
    checkpoint_seconds: float = 1.0  # pause to write one
    restart_seconds: float = 30.0  # detect + replace + restart, after the failed node is back
    reconfigure_seconds: float = 5.0  # elastic: pause to shrink or grow the job

    def __post_init__(self) -> None:
        require(self.checkpoint_every >= 1, "dp.checkpoint_every", self.checkpoint_every, ">= 1")
        for name in ("checkpoint_seconds", "restart_seconds", "reconfigure_seconds"):
            require(getattr(self, name) >= 0, f"dp.{name}", getattr(self, name), "must be >= 0")


@dataclass(frozen=True)
class RunConfig:
    name: str = "demo"
    runtime: str = "sim"
    seed: int = 0
    model: str = "gpt-1m"
    methods: tuple[str, ...] = ("decoupled", "data_parallel")
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    dp: DPConfig = field(default_factory=DPConfig)
    chaos: tuple[ChaosEvent, ...] = ()  # explicit events
    chaos_gen: ChaosGenerators = field(default_factory=ChaosGenerators)
    chaos_plan: str = ""  # replay: a chaos_plan.json from an earlier run (generators off)

    def __post_init__(self) -> None:
        require(self.runtime == "sim", "runtime", self.runtime, "only 'sim' is available yet")
        for m in self.methods:
            require(m in METHODS, "methods", m, f"known: {', '.join(METHODS)}")
        require(
            len(self.hardware.speed) in (0, self.train.learners),
            "hardware.speed",
            self.hardware.speed,
            f"need one factor per learner ({self.train.learners})",
        )
        slots = self.train.learners + self.train.scavenged
        for event in self.chaos:
            require(
                event.learner < slots,
                "chaos.learner",
                event.learner,
                f"no such learner slot (train.learners + train.scavenged = {slots})",
            )
        require(
            self.sync.quorum <= self.train.learners,
            "sync.quorum",
            self.sync.quorum,
            f"K must be <= train.learners ({self.train.learners})",
        )


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"{prefix}{key}", data[key], f"unknown key; known: {sorted(names)}")
    kwargs = {k: _coerce(hints[k], v, f"{prefix}{k}") for k, v in data.items()}
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(key, value, "expected a table")
        return _build(hint, value, key + ".")
    if origin is tuple:
        (item, *_rest) = typing.get_args(hint)
        if not isinstance(value, list | tuple):
            raise ConfigError(key, value, "expected a list")
        return tuple(_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin in (types.UnionType, typing.Union):
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (
        not isinstance(value, hint) or (hint is int and isinstance(value, bool))
    ):
        raise ConfigError(key, value, f"expected {hint.__name__}")
    return value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults, then the TOML file, then ``key=value`` overrides (values parsed as TOML)."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError("config", str(path), "no such file") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", str(path), f"invalid TOML: {exc}") from None
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--set", item, "expected key=value")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # a bare word is a string
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError("--set", item, f"{part} is not a table")
        node[parts[-1]] = value
    return typing.cast(RunConfig, _build(RunConfig, data, ""))


def to_toml(config: RunConfig) -> str:
    """The resolved config as TOML (written to every run directory)."""
    lines: list[str] = []
    tables: list[tuple[str, Any]] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            tables.append((f.name, value))
        elif f.name == "chaos":
            continue
        else:
            lines.append(f"{f.name} = {_toml_value(value)}")
    for name, table in tables:
        lines.append(f"\n[{name}]")
        for f in dataclasses.fields(table):
            lines.append(f"{f.name} = {_toml_value(getattr(table, f.name))}")
    for event in config.chaos:
        lines.append("\n[[chaos]]")
        for f in dataclasses.fields(event):
            lines.append(f"{f.name} = {_toml_value(getattr(event, f.name))}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)
