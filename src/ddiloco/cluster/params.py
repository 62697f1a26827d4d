"""Parameters of the cluster goodput simulator: typed, validated, loaded from TOML.

Every number the simulator uses lives here, with its unit in its name. The defaults are the
ONE parameter set that reproduces the paper's goodput table (docs/simulator.md justifies each
value and says which ones are optimistic); ``PRESETS["realistic"]`` swaps in restart and
reconfiguration times of the order published for real clusters. The paper's reference
numbers are copied here so nothing outside the package is needed at run or test time.
Pure data: no numpy, no torch.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.errors import require
from ddiloco.typed_toml import build, read_toml, set_override

HOURS_PER_YEAR = 8760.0
DECOUPLED_RECOVERY = ("reform", "restart")

# The paper's goodput table (%), per-chip MTBI = 1 year (Decoupled DiLoCo, arXiv 2604.21428).
PAPER_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
PAPER_LEARNERS = (2, 4, 8, 16)
PAPER_TABLE: dict[str, tuple[float, ...]] = {
    "dp": (72, 57, 38, 27, 18),
    "elastic_dp": (88, 80, 69, 58, 40),
    "decoupled_m2": (94, 88, 80, 70, 54),
    "decoupled_m4": (96, 93, 89, 82, 73),
    "decoupled_m8": (98, 96, 94, 88, 80),
    "decoupled_m16": (99, 98, 96, 93, 86),
}
# The acceptance bar: points of goodput per cell.
PAPER_TOLERANCE = {"dp": 5.0, "elastic_dp": 3.0, "decoupled": 3.0}


@dataclass(frozen=True)
class Failures:
    """What fails, how often, and for how long.

    Every chip fails on average once per ``mtbi_hours``; a failure takes out its whole failure
    domain (a host or slice of ``domain_chips`` chips, never a whole learner) until it is
    repaired or replaced, after a log-normal time (median ``repair_median_s``, log-sigma
    ``repair_sigma``). Lifetimes are Weibull with ``weibull_shape`` (1: exponential, i.e.
    Poisson failures; < 1: infant mortality); at time 0 domains have ages uniform in
    [0, ``initial_age_hours``]. With probability ``correlated_probability`` a failure also
    takes down the other domains of its group of ``correlated_domains`` (a rack, a power feed).
    """

    mtbi_hours: float = HOURS_PER_YEAR
    domain_chips: int = 64
    repair_median_s: float = 1200.0
    repair_sigma: float = 1.0
    weibull_shape: float = 1.0
    initial_age_hours: float = 0.0
    correlated_probability: float = 0.0
    correlated_domains: int = 1

    def __post_init__(self) -> None:
        _positive(self, "failures", ("mtbi_hours", "repair_median_s", "weibull_shape"))
        _non_negative(self, "failures", ("repair_sigma", "initial_age_hours"))
        require(self.domain_chips >= 1, "failures.domain_chips", self.domain_chips, ">= 1")
        require(
            0.0 <= self.correlated_probability <= 1.0,
            "failures.correlated_probability",
            self.correlated_probability,
            "must be in [0, 1]",
        )
        require(
            self.correlated_domains >= 1,
            "failures.correlated_domains",
            self.correlated_domains,
            "must be >= 1",
        )


@dataclass(frozen=True)
class Timing:
    """Times every system shares: failure detection, the step, and their spread.

    A synchronous job stalls the moment one of its chips fails (its collective cannot
    complete) and notices after ``detect_s``; the step in flight is lost. ``time_sigma`` is
    the log-normal spread of every restart and reconfiguration time (0: fixed). Synchronous
    groups of n chips step at the pace of their slowest chip: with a per-step jitter of
    ``chip_step_cv`` (coefficient of variation) they lose a factor 1 + cv·E[max of n normals].
    """

    detect_s: float = 5.0
    step_s: float = 1.0
    time_sigma: float = 0.0
    chip_step_cv: float = 0.0

    def __post_init__(self) -> None:
        _positive(self, "timing", ("step_s",))
        _non_negative(self, "timing", ("detect_s", "time_sigma", "chip_step_cv"))


@dataclass(frozen=True)
class DataParallel:
    """Non-elastic data-parallel: any failure stops the job.

    It restarts from the last checkpoint after detection + ``replace_s`` (swap a spare in for
    the failed domain) + ``restart_s``. Checkpoints are taken every ``checkpoint_interval_s``
    of training (0: the Young/Daly optimum sqrt(2·cost·MTBF)), each blocking training for
    ``checkpoint_cost_s``. Failures during a restart join it.
    """

    replace_s: float = 10.0
    restart_s: float = 60.0
    checkpoint_interval_s: float = 1.0
    checkpoint_cost_s: float = 0.0

    def __post_init__(self) -> None:
        _non_negative(
            self,
            "data_parallel",
            ("replace_s", "restart_s", "checkpoint_interval_s", "checkpoint_cost_s"),
        )


@dataclass(frozen=True)
class Elastic:
    """Elastic reconfiguration, used by elastic DP (whole job) and Decoupled learners.

    A failure pauses the job for detection + ``downscale_s``; it continues without the failed
    domain. Failures during any reconfiguration join it (no restart of the reconfiguration).
    Repaired domains rejoin in batched upscale pauses of ``upscale_s``: the first repaired
    domain waits ``upscale_batch_s`` for others; with ``rejoin_in_downscale`` a downscale that
    happens first takes the repaired domains along at no extra cost.
    """

    downscale_s: float = 14.5
    upscale_s: float = 25.0
    upscale_batch_s: float = 150.0
    rejoin_in_downscale: bool = True

    def __post_init__(self) -> None:
        _non_negative(self, "elastic", ("downscale_s", "upscale_s", "upscale_batch_s"))


@dataclass(frozen=True)
class Decoupled:
    """Decoupled DiLoCo: ``learners`` values of M to simulate, and the syncer's quorum K.

    The cluster is split into M learners of N/M chips; a failure affects only its learner.
    ``recovery = "reform"``: the learner re-forms without its failed domain (the elastic mechanics
    above, on N/M chips) and keeps training at reduced capacity. ``"restart"``: the learner stops,
    restarts on a spare (detection + ``data_parallel.replace_s`` + ``restart_s``) and copies its
    state from a peer in ``peer_copy_s``. Merged progress needs K learners up; compute while fewer
    than K are up is wasted. Learners run at persistent speeds spread log-normally by
    ``learner_speed_cv``; progress beyond the K-th fastest learner's pace is not counted.
    """

    learners: tuple[int, ...] = PAPER_LEARNERS
    quorum: int = 1
    recovery: str = "reform"
    peer_copy_s: float = 30.0
    learner_speed_cv: float = 0.0

    def __post_init__(self) -> None:
        _counts("decoupled.learners", self.learners, "M")
        require(self.quorum >= 1, "decoupled.quorum", self.quorum, "must be >= 1")
        smallest = min(self.learners)
        require(
            self.quorum <= smallest,
            "decoupled.quorum",
            self.quorum,
            f"K must be <= M for every M (smallest M = {smallest})",
        )
        require(
            self.recovery in DECOUPLED_RECOVERY,
            "decoupled.recovery",
            self.recovery,
            f"known: {', '.join(DECOUPLED_RECOVERY)}",
        )
        _non_negative(self, "decoupled", ("peer_copy_s", "learner_speed_cv"))


@dataclass(frozen=True)
class Run:
    """What to simulate: cluster sizes, simulated days, seeds."""

    chips: tuple[int, ...] = PAPER_CHIPS
    days: float = 30.0
    seeds: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        _counts("run.chips", self.chips, "cluster size")
        require(self.days > 0, "run.days", self.days, "must be > 0")
        require(self.seeds >= 1, "run.seeds", self.seeds, "must be >= 1")
        require(self.seed >= 0, "run.seed", self.seed, "must be >= 0")


@dataclass(frozen=True)
class ClusterParams:
    """One complete parameter set (defaults: the paper set)."""

    failures: Failures = field(default_factory=Failures)
    timing: Timing = field(default_factory=Timing)
    data_parallel: DataParallel = field(default_factory=DataParallel)
    elastic: Elastic = field(default_factory=Elastic)
    decoupled: Decoupled = field(default_factory=Decoupled)
    run: Run = field(default_factory=Run)

    def __post_init__(self) -> None:
        for n in self.run.chips:
            for m in self.decoupled.learners:
                require(
                    n >= m * self.failures.domain_chips,
                    "run.chips",
                    n,
                    f"M={m} learners need at least one failure domain of "
                    f"{self.failures.domain_chips} chips each",
                )

    @property
    def horizon_s(self) -> float:
        return self.run.days * 86400.0

    @property
    def mtbi_s(self) -> float:
        return self.failures.mtbi_hours * 3600.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Published-order restart and reconfiguration times (docs/simulator.md, "Realistic values").
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "paper": {},
    "realistic": {
        "failures": {"repair_median_s": 1800.0},
        "timing": {"detect_s": 60.0, "time_sigma": 0.5},
        "data_parallel": {
            "replace_s": 120.0,
            "restart_s": 420.0,
            "checkpoint_interval_s": 0.0,
            "checkpoint_cost_s": 10.0,
        },
        "elastic": {"downscale_s": 60.0, "upscale_s": 120.0, "upscale_batch_s": 600.0},
        "decoupled": {"peer_copy_s": 120.0},
    },
}


def load_params(
    path: str | Path | None = None,
    preset: str | None = None,
    overrides: list[str] | None = None,
) -> ClusterParams:
    """Defaults, then a preset, then a TOML file, then ``section.key=value`` overrides."""
    data: dict[str, Any] = {}
    if preset is not None:
        require(preset in PRESETS, "preset", preset, f"known: {', '.join(PRESETS)}")
        _merge(data, PRESETS[preset])
    if path is not None:
        _merge(data, read_toml(path))
    for item in overrides or []:
        set_override(data, item, depth=2)
    return typing.cast(ClusterParams, build(ClusterParams, data))


def replace(params: ClusterParams, section: str, **changes: Any) -> ClusterParams:
    """A copy with some fields of one section changed (validated again)."""
    new = dataclasses.replace(getattr(params, section), **changes)
    return dataclasses.replace(params, **{section: new})


def _merge(into: dict[str, Any], data: dict[str, Any]) -> None:
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = dict(value) if isinstance(value, dict) else value


def _counts(field_name: str, values: tuple[int, ...], what: str) -> None:
    """A list of sizes (cluster sizes, learner counts): at least one, every one >= 1."""
    require(len(values) >= 1, field_name, values, f"at least one {what}")
    for v in values:
        require(v >= 1, field_name, v, f"every {what} must be >= 1")


def _positive(obj: Any, section: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value > 0, f"{section}.{name}", value, "must be > 0")


def _non_negative(obj: Any, section: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value >= 0, f"{section}.{name}", value, "must be >= 0")
