"""The bandwidth planner: the published figures, its formulas, its inverse, bad input."""

from __future__ import annotations

import json

import pytest

from ddiloco.cli import main
from ddiloco.cluster.bandwidth import (
    GRID_RATIO,
    METHODS,
    BandwidthQuery,
    grid_gbps,
    plan,
    required_gbps,
    ring_factor,
    snap_up,
    utilization_at,
)

# The paper's case: 5B parameters, bf16, 1 s step, 2 datacenters, 90% compute utilization.


def test_data_parallel_needs_104_gbit_per_s():
    q = BandwidthQuery("dp")
    # 80 Gbit of gradient within the backward pass (2/3 s) + the exposed 1/0.9 − 1 s
    assert required_gbps(q)["gbit_per_s"] == pytest.approx(80 / (2 / 3 + 1 / 9))  # 102.86
    assert round(grid_gbps(q), 1) == 104.8  # printed as 104
    assert grid_gbps(q) == pytest.approx(104.0, rel=0.01)


def test_decoupled_needs_1_7_gbit_per_s():
    q = BandwidthQuery("decoupled", fragments=24, overlap=2)
    # one fragment (80/24 Gbit) per step, τ = 2 steps + the exposed time to move it
    assert required_gbps(q)["gbit_per_s"] == pytest.approx(80 / 24 / (2 + 1 / 9))  # 1.579
    assert round(grid_gbps(q), 2) == 1.68
    assert round(grid_gbps(q), 1) == 1.7


def test_decoupled_int4_needs_about_0_43_gbit_per_s():
    q = BandwidthQuery("decoupled", bits=4)
    assert required_gbps(q)["gbit_per_s"] == pytest.approx(1.579 / 4, rel=1e-3)  # 0.395
    # The published 0.43 is the bf16 figure over 4 (1.7 / 4 = 0.425); the grid bf16 figure
    # over 4 is 0.419: within the published figure's rounding of 0.43, not equal to it.
    assert grid_gbps(q) == pytest.approx(0.43, abs=0.015)
    assert round(grid_gbps(q), 2) == 0.42


def test_the_published_ratios_60x_and_240x():
    dp = grid_gbps(BandwidthQuery("dp"))
    assert 60 <= dp / grid_gbps(BandwidthQuery("decoupled")) <= 65
    assert 240 <= dp / grid_gbps(BandwidthQuery("decoupled", bits=4)) <= 255


def test_grid_is_log_spaced_with_ratio_1_207_and_snaps_up():
    assert abs(GRID_RATIO - 1.207) < 1e-3
    assert snap_up(102.9) == pytest.approx(104.81, abs=0.01)
    assert snap_up(1.58) == pytest.approx(1.677, abs=0.001)
    for x in (0.15, 0.9, 3.3, 47.0, 500.0):
        assert x <= snap_up(x) < x * GRID_RATIO * (1 + 1e-9)
    assert snap_up(snap_up(7.0)) == pytest.approx(snap_up(7.0))


def test_ring_all_reduce_factor():
    assert ring_factor(2) == 1.0
    assert ring_factor(4) == 1.5
    two = required_gbps(BandwidthQuery("dp", datacenters=2))["gbit_per_s"]
    eight = required_gbps(BandwidthQuery("dp", datacenters=8))["gbit_per_s"]
    assert eight / two == pytest.approx(2 * 7 / 8)


def test_diloco_moves_the_model_every_h_steps_without_overlap():
    q = BandwidthQuery("diloco", inner_steps=100)
    assert required_gbps(q)["gbit_per_s"] == pytest.approx(80 / (100 * (1 / 0.9 - 1)))  # 7.2


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("sustained", [False, True])
def test_utilization_at_the_required_bandwidth_is_the_target(method, sustained):
    for target in (0.5, 0.9, 0.99):
        q = BandwidthQuery(method, utilization=target, inner_steps=60)
        need = required_gbps(q, sustained)["gbit_per_s"]
        assert utilization_at(q, need, sustained) == pytest.approx(target, rel=1e-9)
        assert utilization_at(q, need * 0.8, sustained) < target
        assert utilization_at(q, need * 1.25, sustained) > target or target > 0.98


def test_overlapping_transfers_need_the_average_rate_too():
    q = BandwidthQuery("decoupled")  # one fragment every step, τ = 2: two in flight
    need = required_gbps(q, sustained=True)
    assert need["sustained"] == pytest.approx(80 / 24 * 0.9)  # 3.0 Gbit/s
    assert need["gbit_per_s"] == need["sustained"] > need["deadline"]
    roomy = BandwidthQuery("decoupled", inner_steps=100)  # a fragment every 4.2 steps
    assert required_gbps(roomy, sustained=True)["gbit_per_s"] == pytest.approx(
        required_gbps(roomy)["deadline"]
    )


def test_bandwidth_json_interface(capsys):
    argv = "bandwidth --method dp --params 5e9 --bits 16 --step-time 1 --utilization 0.9"
    argv += " --datacenters 2 --json"
    assert main(argv.split()) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gbit_per_s"] == pytest.approx(102.857, abs=1e-3)
    argv = "bandwidth --method decoupled --fragments 24 --overlap 2 --grid --bandwidth 1.0 --json"
    assert main(argv.split()) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gbit_per_s"] == pytest.approx(1.677, abs=1e-3)
    assert data["raw_gbit_per_s"] == pytest.approx(1.579, abs=1e-3)
    assert 0 < data["utilization_at_bandwidth"] < 0.9
    assert data["sustained_gbit_per_s"] == pytest.approx(3.0)


def test_bandwidth_comparison_table(capsys):
    assert main(["bandwidth", "--grid"]) == 0
    out = capsys.readouterr().out
    for text in ("104.8", "1.677", "0.4192", "decoupled int4", "--sustained"):
        assert text in out
    assert main(["bandwidth", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["methods"]) == {*METHODS, "decoupled int4"}
    assert plan(BandwidthQuery("streaming"))["times_less_than_dp"] > 60


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--method", "carrier-pigeon"], "method='carrier-pigeon'"),
        (["--method", "dp", "--params", "0"], "params=0.0"),
        (["--method", "dp", "--params=-5e9"], "params=-5000000000.0"),
        (["--method", "dp", "--step-time", "0"], "step_time_s=0.0"),
        (["--method", "dp", "--utilization", "1.5"], "utilization=1.5"),
        (["--method", "dp", "--datacenters", "1"], "datacenters=1"),
        (["--method", "dp", "--bits", "0"], "bits=0.0"),
        (["--method", "decoupled", "--fragments", "0"], "fragments=0"),
        (["--method", "dp", "--bandwidth", "0"], "bandwidth=0.0"),
    ],
)
def test_bad_input_is_a_clear_error_naming_the_field(argv, needle, capsys):
    assert main(["bandwidth", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
