"""Run configuration: typed dataclasses, loaded from TOML and ``--set key=value`` overrides.

One ``RunConfig`` describes a whole experiment (model, data, training, sync algorithm, the
simulated hardware and network, the chaos plan, the methods to compare). Unknown keys and
wrong types are refused with the dotted key named, so a typo never silently runs defaults.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.chaos.plan import LINK_KINDS, ChaosEvent, ChaosGenerators
from ddiloco.config_sync import DiLoCoConfig, StreamingConfig, SyncConfig, move_flat_keys
from ddiloco.errors import ConfigError, require
from ddiloco.typed_toml import build, read_toml, set_override

METHODS = ("decoupled", "decoupled_sync", "streaming", "diloco", "data_parallel", "elastic_dp")


OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("cosine", "linear", "constant")
PRECISIONS = ("auto", "fp32", "bf16")
PARALLELS = ("ddp", "fsdp")  # how a learner of several ranks spreads over them
MAX_MMAP_THRESHOLD = 32 << 20  # glibc's largest mmap threshold (HEAP_MAX_SIZE / 2, 64-bit)
_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?\.?")  # processes.http_hosts


@dataclass(frozen=True)
class DataConfig:
    # the built-in corpus, a text file or directory (byte tokens), or a directory written by
    # `ddiloco data prepare` (memory-mapped token files with their tokenizer)
    source: str = "shakespeare"
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
    # GPUs one learner takes (0: auto, one per rank on CUDA); a learner never shares a device
    gpus_per_learner: int = 0
    seq_len: int = 0  # tokens per training sequence (0: the model's context)
    grad_accum: int = 1  # micro-batches of batch_size per step (a step trains their sum)
    optimizer: str = "adamw"  # the inner optimizer: adamw, or sgd (momentum betas[0], Nesterov)
    betas: tuple[float, ...] = (0.9, 0.95)
    eps: float = 1e-8
    schedule: str = "cosine"  # after the warmup: cosine, linear (both to min_lr_ratio), constant
    min_lr_ratio: float = 0.1
    precision: str = "auto"  # auto (bf16 autocast on CUDA that supports it), fp32, bf16
    checkpoint_every: int = 0  # tokens between checkpoints of the global model (0: at the end)
    # "module:function": your own training loop (ddiloco.Learner) as every learner of a
    # processes or Ray run; "": ddiloco's own loop (docs/own_loop.md)
    entry: str = ""
    # "module:function": function(model, batches) -> mean loss, the evaluation of the global
    # model; "": ddiloco's (model(inputs, targets) -> (logits, loss), nats per token)
    evaluate: str = ""
    # how a learner of processes.ranks >= 2 spreads over its ranks: "ddp" (each rank holds
    # the whole model, gradients averaged) or "fsdp" (FSDP2: each rank holds 1/R of the
    # parameters, gradients and optimizer state)
    parallel: str = "ddp"
    # keep each block's input only and recompute its activations in backward: activations
    # of one block at a time for about one more forward a step (models/recompute.py)
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("entry", "evaluate"):
            value = getattr(self, name)
            module, _, function = value.partition(":")
            require(
                not value or bool(module and function),
                f"train.{name}",
                value,
                "name your function as module:function (or leave it empty)",
            )
        for name in ("learners", "batch_size", "tokens", "eval_every", "grad_accum"):
            require(getattr(self, name) >= 1, f"train.{name}", getattr(self, name), "must be >= 1")
        require(self.seq_len >= 0, "train.seq_len", self.seq_len, "must be >= 0 (0: the model's)")
        choices = {
            "optimizer": OPTIMIZERS,
            "schedule": SCHEDULES,
            "precision": PRECISIONS,
            "parallel": PARALLELS,
        }
        for name, known in choices.items():
            value = getattr(self, name)
            require(value in known, f"train.{name}", value, f"known: {', '.join(known)}")
        require(
            len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
            "train.betas",
            self.betas,
            "need two values in [0, 1)",
        )
        require(self.eps > 0, "train.eps", self.eps, "must be > 0")
        require(
            0.0 <= self.min_lr_ratio <= 1.0, "train.min_lr_ratio", self.min_lr_ratio, "in [0, 1]"
        )
        require(self.checkpoint_every >= 0, "train.checkpoint_every", self.checkpoint_every, ">= 0")
        require(self.scavenged >= 0, "train.scavenged", self.scavenged, "must be >= 0")
        require(
            self.gpus_per_learner >= 0,
            "train.gpus_per_learner",
            self.gpus_per_learner,
            "must be >= 0 (0: one per rank on CUDA)",
        )
        require(
            self.max_virtual_seconds >= 0,
            "train.max_virtual_seconds",
            self.max_virtual_seconds,
            "must be >= 0",
        )
        require(self.lr > 0, "train.lr", self.lr, "must be > 0")


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
class DataParallelConfig:
    """Data-parallel baselines under failures (simulated seconds)."""

    checkpoint_every: int = 50  # steps between checkpoints (non-elastic restarts from one)
    checkpoint_seconds: float = 1.0  # pause to write one
    restart_seconds: float = 30.0  # detect + replace + restart, after the failed node is back
    reconfigure_seconds: float = 5.0  # elastic: pause to shrink or grow the job

    def __post_init__(self) -> None:
        require(
            self.checkpoint_every >= 1,
            "data_parallel.checkpoint_every",
            self.checkpoint_every,
            ">= 1",
        )
        for name in ("checkpoint_seconds", "restart_seconds", "reconfigure_seconds"):
            require(
                getattr(self, name) >= 0,
                f"data_parallel.{name}",
                getattr(self, name),
                "must be >= 0",
            )


@dataclass(frozen=True)
class ProcessesConfig:
    """The real-processes runtime (``runtime = "processes"``): wall-clock seconds."""

    bind: str = "127.0.0.1:0"  # the syncer's HOST:PORT (port 0: a free one); loopback default
    peer_port: int = 0  # each learner's peer-recovery TCP port (0: a free one; fixed: firewalls)
    restart: bool = True  # restart a learner process that dies (it recovers from a peer)
    restart_delay_seconds: float = 1.0
    detect_seconds: float = 5.0  # silence after which the syncer gives a learner up
    journal: bool = False  # keep every merge's inputs on disk (audits, tests)
    max_wall_seconds: float = 3600.0  # the launcher stops everything after this
    proxy: str = ""  # faults between learners and syncer, e.g. "drop=0.02,corrupt=0.01"
    ranks: int = 1  # data-parallel ranks per learner (torchrun; only rank 0 talks)
    threads: int = 1  # torch CPU threads of each learner process (each rank's)
    spares: int = 0  # warm spare learner processes that take a dead learner's slot (0: none)
    shared_memory: bool = True  # same-host fragments through /dev/shm (off behind a proxy)
    give_up_seconds: float = 60.0  # a learner that hears no syncer this long exits non-zero
    # a syncer whose main loop has not turned this long is stuck (a deadlock, a hung disk):
    # it dumps every thread's stack and exits, to be restarted from its store, so that its
    # network thread's beats never keep the learners training alone behind it (0: never)
    stuck_seconds: float = 600.0
    max_restarts: int = 5  # failed starts in a row of one process before the launcher gives up
    restart_backoff_cap_seconds: float = 30.0  # restart delays double up to this
    learner_checkpoint_every: float = 60.0  # seconds between a learner's local checkpoints (0: off)
    # glibc: a learner's allocations of at least this many bytes get mappings of their own,
    # returned when freed (its all-gather, attention and MLP buffers), the rest come from the
    # heap; 0: glibc's sliding threshold (up to 32 MiB, whose freed buffers stay resident)
    learner_mmap_threshold: int = 8 << 20
    # at the budget every live learner pauses and is asked for every fragment once more; the
    # final rounds merge when all answered, or after this long with what came (0: no final
    # rounds: what the learners trained since their last merged answers is thrown away)
    final_round_seconds: float = 30.0
    # the syncer evaluates the global model in place, slice by slice, merges going in between
    # two slices (no copy: the syncer stays within 3x the fp32 model; an evaluation that
    # outlasts merges averages over the models they made), instead of in a copy taken between
    # two merges (one model exactly; one fp32 model more while it runs). Decision 126
    eval_in_place: bool = False
    # the syncer's read-only status page, JSON and Prometheus metrics (HOST:PORT, port 0: a
    # free one; "": off). Its URL is printed and written to <run>/status_url.
    http: str = "127.0.0.1:0"
    # names (besides IP literals, localhost and the bound name) that requests to processes.http
    # may carry in their Host header, e.g. a reverse proxy's ["status.example.org"]; any other
    # name is refused (421): a DNS-rebinding page cannot read the status
    http_hosts: tuple[str, ...] = ()
    # the page's actions (kill / leave a learner, with the run secret): "auto" (on when
    # processes.http binds loopback only), "on", "off"
    http_actions: str = "auto"

    def __post_init__(self) -> None:
        require(
            self.http_actions in ("auto", "on", "off"),
            "processes.http_actions",
            self.http_actions,
            "one of auto, on, off",
        )
        for name in self.http_hosts:
            require(
                isinstance(name, str) and _HOST_NAME.fullmatch(name) is not None,
                "processes.http_hosts",
                name,
                "a host name without port (letters, digits, '.', '-')",
            )
        require(self.max_restarts >= 0, "processes.max_restarts", self.max_restarts, ">= 0")
        require(0 <= self.peer_port <= 65535, "processes.peer_port", self.peer_port, "0..65535")
        require(
            0 <= self.learner_mmap_threshold <= MAX_MMAP_THRESHOLD,
            "processes.learner_mmap_threshold",
            self.learner_mmap_threshold,
            f"bytes in 0..{MAX_MMAP_THRESHOLD} (glibc's limit; 0: its own sliding threshold)",
        )
        for name in (
            "restart_delay_seconds",
            "detect_seconds",
            "max_wall_seconds",
            "give_up_seconds",
            "restart_backoff_cap_seconds",
        ):
            value = getattr(self, name)
            require(value > 0, f"processes.{name}", value, "must be > 0")
        require(
            self.stuck_seconds == 0 or self.stuck_seconds > self.detect_seconds,
            "processes.stuck_seconds",
            self.stuck_seconds,
            f"must be 0 (never) or > processes.detect_seconds ({self.detect_seconds})",
        )
        require(self.ranks >= 1, "processes.ranks", self.ranks, "must be >= 1")
        require(self.threads >= 1, "processes.threads", self.threads, "must be >= 1")
        require(self.spares >= 0, "processes.spares", self.spares, "must be >= 0")
        require(
            self.final_round_seconds >= 0,
            "processes.final_round_seconds",
            self.final_round_seconds,
            "must be >= 0 (0: off)",
        )
        require(
            self.learner_checkpoint_every >= 0,
            "processes.learner_checkpoint_every",
            self.learner_checkpoint_every,
            "must be >= 0 (0: off)",
        )


@dataclass(frozen=True)
class RayConfig:
    """The Ray runtime (``runtime = "ray"``): the processes runtime's syncer and learners as
    Ray actors on a cluster (docs/deploy.md)."""

    address: str = ""  # a cluster to join ("" : $RAY_ADDRESS, else a local one for this run)
    namespace: str = "ddiloco"  # the named actors' (the syncer is found by its name)
    syncer_resource: str = "ddiloco_syncer"  # a node carrying it hosts the syncer ("": any)
    syncer_cpus: float = 1.0
    learner_cpus: float = 1.0  # reserved per learner actor (its threads: processes.threads)
    place_seconds: float = 30.0  # an actor not placed this long is reported, again each time
    # where the syncer binds and learners serve peer copies ("": each node's address as Ray
    # knows it; 127.0.0.1 when the whole cluster is one machine; a local cluster's default)
    service_host: str = ""

    def __post_init__(self) -> None:
        require(self.syncer_cpus >= 0, "ray.syncer_cpus", self.syncer_cpus, "must be >= 0")
        require(self.learner_cpus >= 0, "ray.learner_cpus", self.learner_cpus, "must be >= 0")
        require(self.place_seconds > 0, "ray.place_seconds", self.place_seconds, "must be > 0")
        require(bool(self.namespace), "ray.namespace", self.namespace, "must not be empty")


@dataclass(frozen=True)
class ReportConfig:
    """What a run shows while it goes (report/progress.py) and where else it writes it."""

    progress_seconds: float = 5.0  # a status line this often (wall seconds; 0: at evals only)
    tensorboard: bool = False  # event files under <run>/tensorboard (report/tensorboard.py)
    wandb: str = ""  # a W&B project: one W&B run per method (report/wandb_sink.py); "": off
    wandb_mode: str = "auto"  # auto (online with an API key, else offline), online, offline

    def __post_init__(self) -> None:
        modes = ("auto", "online", "offline", "disabled")
        require(self.wandb_mode in modes, "report.wandb_mode", self.wandb_mode, f"one of {modes}")
        require(
            self.progress_seconds >= 0,
            "report.progress_seconds",
            self.progress_seconds,
            "must be >= 0 (0: only at evaluations)",
        )


RUNTIMES = ("sim", "processes", "ray")
WALL_CLOCK_RUNTIMES = ("processes", "ray")  # real processes, wall seconds


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
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    processes: ProcessesConfig = field(default_factory=ProcessesConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    chaos: tuple[ChaosEvent, ...] = ()  # explicit events
    chaos_gen: ChaosGenerators = field(default_factory=ChaosGenerators)
    chaos_plan: str = ""  # replay: a chaos_plan.json from an earlier run (generators off)

    def __post_init__(self) -> None:
        require(self.runtime in RUNTIMES, "runtime", self.runtime, f"known: {RUNTIMES}")
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
            self.sync.rounds.quorum <= self.train.learners,
            "sync.rounds.quorum",
            self.sync.rounds.quorum,
            f"K must be <= train.learners ({self.train.learners})",
        )
        self._check_ports(slots)
        require(
            self.train.parallel != "fsdp" or self.processes.ranks >= 2,
            "train.parallel",
            self.train.parallel,
            "shards a learner over its ranks: set processes.ranks >= 2",
        )

    @property
    def proxied(self) -> bool:
        """A wall-clock run of this config puts the fault proxy between learners and syncer:
        for ``processes.proxy``'s wire faults, or to play the plan's link faults."""
        return bool(self.processes.proxy) or any(e.kind in LINK_KINDS for e in self.chaos)

    def _check_ports(self, slots: int) -> None:
        """Fixed ports of one host must differ: learner slot m's peer port is
        ``processes.peer_port + m``, next to the syncer's ``processes.bind`` port and, on Ray,
        the fault proxy's (the bind port + 1, beside the syncer)."""
        first, bind = self.processes.peer_port, self.processes.bind.rpartition(":")[2]
        if not first or not bind.isdigit() or not int(bind):
            return
        taken = {"processes.bind's": int(bind)}
        if self.runtime == "ray" and self.proxied:
            taken["the fault proxy's (processes.bind's + 1)"] = int(bind) + 1
        for name, port in taken.items():
            require(
                not first <= port < first + slots,
                "processes.peer_port",
                first,
                f"learner slots' peer ports {first}..{first + slots - 1} include {name} {port}",
            )


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults, then the TOML file, then ``key=value`` overrides (values parsed as TOML)."""
    data: dict[str, Any] = read_toml(path) if path is not None else {}
    for item in overrides or []:
        set_override(data, item)
    moved: dict[str, str] = {}
    data = move_flat_keys(data, moved)
    try:
        return typing.cast(RunConfig, build(RunConfig, data))
    except ConfigError as exc:
        if exc.field not in moved:
            raise
        why = f"{exc.why} (given as {moved[exc.field]}, its earlier name)"
        raise type(exc)(exc.field, exc.value, why) from None


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
    while tables:  # (a table's own tables follow it: [sync], then [sync.rounds], ...)
        name, table = tables.pop(0)
        lines.append(f"\n[{name}]")
        inner = []
        for f in dataclasses.fields(table):
            value = getattr(table, f.name)
            if dataclasses.is_dataclass(value):
                inner.append((f"{name}.{f.name}", value))
            else:
                lines.append(f"{f.name} = {_toml_value(value)}")
        tables[:0] = inner
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
