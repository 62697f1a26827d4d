"""The cluster goodput simulator: closed forms, the paper's table, determinism, bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ddiloco.cli import main
from ddiloco.cluster.failures import learner_bounds, sample_trace
from ddiloco.cluster.goodput import (
    checkpoint_interval,
    pause_chain,
    simulate_decoupled,
    simulate_dp,
    simulate_elastic,
)
from ddiloco.cluster.params import (
    PAPER_CHIPS,
    PAPER_TABLE,
    ClusterParams,
    load_params,
    replace,
)
from ddiloco.cluster.table import run_table, simulate_cell, to_json, tolerance, worst_deviation

ROOT = Path(__file__).resolve().parents[2]
YEAR_S = 8760 * 3600.0


def quick(p: ClusterParams, **run) -> ClusterParams:
    return replace(p, "run", **run)


def seeds_of(fn, n: int) -> np.ndarray:
    return np.array([fn(np.random.default_rng(1000 + i)) for i in range(n)])


def agree(samples: np.ndarray, expected: float, slack: float = 0.0) -> None:
    """Mean within 4 standard errors (plus a stated model slack) of the closed form."""
    se = samples.std(ddof=1) / math.sqrt(samples.size)
    assert abs(samples.mean() - expected) <= 4 * se + slack, (samples.mean(), expected, se)


# ---- failure process ------------------------------------------------------------------------


def test_cluster_mtbf_is_mtbi_over_chips():
    p = load_params(overrides=["failures.repair_median_s=1.0"])
    trace = sample_trace(np.random.default_rng(0), 2_400_000, 3 * 86400.0, p.failures)
    gaps = np.diff(trace.time)
    mtbf = YEAR_S / 2_400_000
    assert 13.0 < mtbf < 13.3  # "13 s at 2.4M chips"
    assert abs(gaps.mean() - mtbf) < 4 * mtbf / math.sqrt(gaps.size)
    assert abs(trace.domains - 2_400_000 / 64) < 1


def test_weibull_lifetimes_keep_the_long_run_rate():
    p = load_params(overrides=["failures.weibull_shape=0.7", "failures.repair_median_s=1.0",
                               "failures.mtbi_hours=1536.0"])  # fmt: skip  # domain life: 1 day
    horizon = 200 * 86400.0
    trace = sample_trace(np.random.default_rng(1), 64 * 500, horizon, p.failures)
    expected = 500 * 200  # domains x days
    assert abs(len(trace) / expected - 1) < 0.03


def test_correlated_failures_take_down_the_whole_group():
    p = load_params(
        overrides=["failures.correlated_probability=1.0", "failures.correlated_domains=4"]
    )
    trace = sample_trace(np.random.default_rng(2), 64 * 400, 5 * 86400.0, p.failures)
    _, counts = np.unique(trace.time, return_counts=True)
    assert (counts == 4).mean() > 0.95
    first = np.searchsorted(trace.time, np.unique(trace.time))
    groups = trace.domain // 4
    assert all(len(set(groups[i : i + 4])) == 1 for i in first[:200])


def test_learners_split_domains_into_contiguous_nearly_equal_ranges():
    bounds = learner_bounds(37, 4)
    assert bounds[0][0] == 0 and bounds[-1][1] == 37
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_a_failure_during_a_pause_joins_it_and_repairs_are_batched():
    # outages at 0 and 5 (one pause of 20 s), repairs at 100 and 130, batch 60, upscale 10
    pauses = pause_chain(
        [0.0, 5.0, 500.0], [20.0, 20.0, 20.0], [100.0, 130.0], [10.0] * 4, 60.0, True, 1000.0
    )
    assert pauses.start.tolist() == [0.0, 160.0, 500.0]
    assert pauses.upscale.tolist() == [False, True, False]
    assert pauses.end.tolist() == [20.0, 170.0, 520.0]


def test_zero_restart_and_reconfiguration_times_are_the_ideal_limit():
    zero = [
        "timing.detect_s=0.0",
        "data_parallel.replace_s=0.0",
        "data_parallel.restart_s=0.0",
        "elastic.downscale_s=0.0",
        "elastic.upscale_s=0.0",
        "elastic.upscale_batch_s=0.0",
        "timing.step_s=0.000001",
    ]
    p = quick(load_params(overrides=zero), chips=(150_000,), seeds=1, days=1.0)
    for name, outcome in simulate_cell(p, 150_000, 0).items():
        assert outcome.uptime == pytest.approx(1.0), name
        assert outcome.goodput > 0.995, name  # only capacity out for repair is lost


# ---- closed forms ---------------------------------------------------------------------------


def test_dp_matches_the_renewal_formula_and_young_daly():
    chips, cost, restart = 16_384, 10.0, 60.0
    p = load_params(
        overrides=[
            "timing.detect_s=0.0",
            "data_parallel.replace_s=0.0",
            "failures.repair_median_s=1.0",
            f"data_parallel.restart_s={restart}",
            "data_parallel.checkpoint_interval_s=0.0",
            f"data_parallel.checkpoint_cost_s={cost}",
            "run.days=60.0",
        ]
    )
    mtbf = YEAR_S / chips
    c = checkpoint_interval(p, chips)
    assert c == pytest.approx(math.sqrt(2 * cost * mtbf))  # Young's optimum
    lam = 1 / mtbf
    q = math.exp(-lam * (c + cost))
    exact = c * q / (1 - q) * lam / (1 + lam * restart)

    def goodput(rng: np.random.Generator, params: ClusterParams = p) -> float:
        trace = sample_trace(rng, chips, params.horizon_s, params.failures)
        return simulate_dp(trace, params, rng).goodput

    samples = seeds_of(goodput, 6)
    agree(samples, exact, slack=0.002)  # slack: the run's end is not a failure
    young_waste = cost / c + (c / 2 + restart) / mtbf  # first order in c/MTBF
    assert abs((1 - samples.mean()) - young_waste) < 0.1 * young_waste
    for factor in (0.25, 4.0):  # the optimum beats intervals 4x shorter or longer
        other = replace(p, "data_parallel", checkpoint_interval_s=c * factor)
        assert seeds_of(lambda r, o=other: goodput(r, o), 6).mean() < samples.mean()


# Every failure costs one pause and nothing else: instant upscale, fixed repair time, steps
# too short to lose work to, ten days of failures.
ONE_PAUSE = (
    "elastic.upscale_s=0.0",
    "elastic.upscale_batch_s=0.0",
    "failures.repair_sigma=0.0",
    "timing.step_s=0.000001",
    "run.days=10.0",
)


def pause_goodput(chips: float, repair: float, pause: float) -> float:
    """(1 - u) / (1 + lambda * pause) for a job of ``chips`` (a failure a chip a year,
    taking its 64-chip domain out for ``repair`` seconds)."""
    u = repair / (YEAR_S / 64 + repair)  # Little: share of domains out for repair
    lam = chips / YEAR_S * (1 - u)  # a domain under repair cannot fail again
    return (1 - u) / (1 + lam * pause)


@pytest.mark.parametrize("chips", [300_000, 1_200_000])
def test_elastic_goodput_is_one_minus_u_over_one_plus_lambda_p(chips):
    pause, repair = 20.0, 3600.0
    overrides = ["timing.detect_s=5.0", f"elastic.downscale_s={pause - 5}"]
    p = load_params(overrides=[*overrides, f"failures.repair_median_s={repair}", *ONE_PAUSE])
    expected = pause_goodput(chips, repair, pause)

    def goodput(rng: np.random.Generator) -> float:
        return simulate_elastic(sample_trace(rng, chips, p.horizon_s, p.failures), p, rng).goodput

    agree(seeds_of(goodput, 4), expected, slack=0.001)


def test_a_decoupled_learner_is_an_elastic_job_of_n_over_m_chips():
    chips, m = 1_200_000, 4
    p = load_params(overrides=["failures.repair_median_s=600.0", *ONE_PAUSE])
    pause = p.timing.detect_s + p.elastic.downscale_s
    expected = pause_goodput(chips / m, 600.0, pause)

    def goodput(rng: np.random.Generator) -> float:
        trace = sample_trace(rng, chips, p.horizon_s, p.failures)
        return simulate_decoupled(trace, p, m, rng).goodput

    agree(seeds_of(goodput, 4), expected, slack=0.001)


def test_quorum_k_equals_m_needs_every_learner_up():
    chips, m = 600_000, 4
    base = load_params(
        overrides=[
            "elastic.upscale_s=0.0",
            "run.days=10.0",
            "decoupled.learners=[4]",
            "failures.repair_median_s=1.0",
        ]
    )
    pause = base.timing.detect_s + base.elastic.downscale_s
    sync = replace(base, "decoupled", quorum=m)
    per_learner_up = 1 / (1 + chips / m / YEAR_S * pause)

    def run(params: ClusterParams, rng: np.random.Generator):
        trace = sample_trace(rng, chips, params.horizon_s, params.failures)
        return simulate_decoupled(trace, params, m, rng)

    ups = seeds_of(lambda r: run(sync, r).uptime, 4)
    agree(ups, per_learner_up**m, slack=0.003)  # learners are independent
    rng = np.random.default_rng(5)
    relaxed, strict = run(base, rng), run(sync, np.random.default_rng(5))
    assert strict.badput["quorum"] > 0.01 and relaxed.badput["quorum"] == 0.0
    assert strict.goodput < relaxed.goodput and strict.uptime < relaxed.uptime


def test_stragglers_and_slow_learners_cost_goodput():
    p = quick(load_params(), chips=(150_000,), seeds=1, days=2.0)
    plain = simulate_cell(p, 150_000, 0)
    jitter = load_params(
        overrides=[
            "timing.chip_step_cv=0.02",
            "decoupled.learner_speed_cv=0.2",
            "decoupled.quorum=2",
        ]
    )
    slow = simulate_cell(quick(jitter, chips=(150_000,), seeds=1, days=2.0), 150_000, 0)
    assert slow["dp"].badput["stragglers"] > 0.05  # the max of 150K normals is ~4.5 sigma
    assert slow["decoupled_m16"].goodput < plain["decoupled_m16"].goodput
    assert slow["decoupled_m16"].badput["learner_speed"] > 0


def test_a_restarting_learner_pays_replacement_restart_and_peer_copy():
    p = quick(load_params(overrides=['decoupled.recovery="restart"']), seeds=1, days=2.0)
    restart = simulate_cell(p, 600_000, 0)["decoupled_m8"]
    reform = simulate_cell(quick(load_params(), seeds=1, days=2.0), 600_000, 0)["decoupled_m8"]
    assert restart.badput["restart"] > 0.05 and "downscale" not in restart.badput
    assert restart.goodput < reform.goodput


# ---- the table ------------------------------------------------------------------------------


def check_paper_table(data: dict) -> None:
    assert data["chips"] == list(PAPER_CHIPS)
    for system, ref in PAPER_TABLE.items():
        ours = data["table"][system]
        assert len(ours) == 5
        tol = tolerance(system)
        misses = [
            (n, o, r) for n, o, r in zip(PAPER_CHIPS, ours, ref, strict=True) if abs(o - r) > tol
        ]
        assert not misses, (system, misses)


def test_the_default_parameter_set_reproduces_the_paper_table_fast():
    result = run_table(quick(load_params(), seeds=1, days=15.0))
    check_paper_table(to_json(result))
    assert worst_deviation(result)["dp"] > 2  # the non-elastic row is the loosest fit


@pytest.mark.slow
def test_ddiloco_simulate_with_no_arguments_is_the_paper_table(capsys):
    assert main(["simulate", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    check_paper_table(data)
    assert data["params"]["run"]["seeds"] == 3 and data["params"]["run"]["days"] == 30.0


def test_realistic_restart_times_miss_the_paper_by_far():
    result = to_json(
        run_table(
            quick(load_params(preset="realistic"), seeds=1, days=5.0, chips=(150_000, 2_400_000))
        )
    )
    dp, elastic, m16 = (result["table"][s] for s in ("dp", "elastic_dp", "decoupled_m16"))
    assert dp[0] < 30 and elastic[0] < 75  # paper: 72 and 88
    assert m16[0] > 85 and m16[1] > 3 * elastic[1]  # Decoupled keeps most of its advantage


def test_goodput_and_badput_add_up_to_everything():
    p = quick(load_params(overrides=["decoupled.quorum=2"]), seeds=1, days=2.0)
    for outcome in simulate_cell(p, 300_000, 0).values():
        assert outcome.goodput + sum(outcome.badput.values()) == pytest.approx(1.0, abs=1e-9)
        assert 0 < outcome.goodput <= outcome.uptime + 1e-9 <= 1 + 1e-9


def test_same_seed_same_table_other_seed_other_table():
    p = quick(load_params(), chips=(150_000, 600_000), seeds=2, days=1.0)
    a, b = to_json(run_table(p)), to_json(run_table(p))
    for d in (a, b):
        d.pop("seconds")
    assert a == b
    c = to_json(run_table(replace(p, "run", seed=1)))
    assert c["table"] != a["table"]


def test_shipped_configs_are_the_built_in_presets():
    assert load_params(ROOT / "configs/cluster_paper.toml") == load_params()
    realistic = load_params(ROOT / "configs/cluster_realistic.toml")
    assert realistic == load_params(preset="realistic")


def test_the_cluster_package_never_imports_torch():
    code = (
        "import sys, ddiloco.cluster.table, ddiloco.cluster.bandwidth, ddiloco.cluster.plot; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- command line ---------------------------------------------------------------------------


def test_simulate_json_interface(capsys, tmp_path):
    png = tmp_path / "goodput.png"
    argv = [
        "simulate",
        "--chips",
        "150K",
        "300000",
        "--learners",
        "2",
        "4",
        "--seeds",
        "2",
        "--days",
        "1",
        "--plot",
        str(png),
        "--json",
    ]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chips"] == [150_000, 300_000]
    assert set(data["table"]) == {"dp", "elastic_dp", "decoupled_m2", "decoupled_m4"}
    for key in ("table", "uptime", "uptime_ci95", "badput", "ci95"):
        assert all(len(v) == 2 for v in data[key].values())
    assert "downscale" in data["badput"]["elastic_dp"][0]
    assert data["params"]["failures"]["mtbi_hours"] == 8760.0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_simulate_table_for_people_shows_the_paper_beside_ours(capsys):
    assert main(["simulate", "--chips", "1.2M", "--seeds", "1", "--days", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "[58, " in out and "[93, " in out  # elastic DP and M=16 at 1.2M
    assert "badput (%) by cause" in out and "uptime (%)" in out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--chips", "0"], "run.chips=0"),
        (["--chips=-150K"], "run.chips=-150000"),
        (["--chips", "lots"], "chips='lots'"),
        (["--mtbi-hours", "0"], "failures.mtbi_hours=0.0"),
        (["--set", "timing.detect_s=-1"], "timing.detect_s=-1.0"),
        (["--set", "data_parallel.restart_s=-5"], "data_parallel.restart_s=-5.0"),
        (["--set", "failures.repair_median_s=0"], "failures.repair_median_s=0.0"),
        (["--days", "0"], "run.days=0.0"),
        (["--learners", "2", "4", "--quorum", "3"], "decoupled.quorum=3"),
        (["--set", "decoupled.recovery=pray"], "decoupled.recovery='pray'"),
        (["--set", "elastic.teleport_s=1"], "elastic.teleport_s"),
        (["--set", "data_parallel.restart_s=fast"], "data_parallel.restart_s='fast'"),
        (["--config", "no/such/file.toml"], "config='no/such/file.toml'"),
        (["--chips", "1000", "--learners", "32"], "run.chips=1000"),
    ],
)
def test_bad_input_is_a_clear_error_naming_the_field(argv, needle, capsys):
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
