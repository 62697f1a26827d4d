"""Chaos plans: generated failures follow their rate, expansion is seeded, replay is exact."""

from __future__ import annotations

import json
import random

import pytest

from ddiloco.chaos.plan import ChaosEvent, ChaosGenerators, expand, load_plan, to_json
from ddiloco.errors import ConfigError


def test_failure_count_matches_the_rate():
    gen = ChaosGenerators(mtbi_hours=1.0, chips_per_learner=10, recovery_seconds=1.0)
    rate = gen.crash_rate()
    assert rate == pytest.approx(10 / 3600)
    horizon = 200_000.0
    events = expand((), gen, 4, 0, horizon, random.Random(1))
    expected = 4 * horizon / (1 / rate + 1.0)  # renewal process: mean gap + mean downtime
    assert len(events) == pytest.approx(expected, rel=0.1)
    assert all(e.kind == "crash" and 0 <= e.learner < 4 and e.at < horizon for e in events)


def test_expansion_is_seeded_sorted_and_keeps_explicit_events():
    gen = ChaosGenerators(
        mtbi_hours=0.5,
        chips_per_learner=2,
        scavenge_join_at=5.0,
        scavenge_stagger=3.0,
        scavenge_stay=10.0,
    )
    explicit = (ChaosEvent(7.0, "slow", 1, 5.0, 1.5),)
    a = expand(explicit, gen, 3, 2, 5000.0, random.Random(9))
    b = expand(explicit, gen, 3, 2, 5000.0, random.Random(9))
    assert a == b and a != expand(explicit, gen, 3, 2, 5000.0, random.Random(10))
    assert explicit[0] in a
    assert [e.at for e in a] == sorted(e.at for e in a)
    scavenging = [(e.kind, e.learner, e.at) for e in a if e.kind in ("join", "leave")]
    assert scavenging == [
        ("join", 3, 5.0),
        ("join", 4, 8.0),
        ("leave", 3, 15.0),
        ("leave", 4, 18.0),
    ]


def test_plan_round_trips_through_json(tmp_path):
    events = expand((), ChaosGenerators(mtbi_hours=0.2), 2, 0, 3000.0, random.Random(3))
    path = tmp_path / "chaos_plan.json"
    path.write_text(json.dumps(to_json(events)))
    assert load_plan(path) == events


@pytest.mark.parametrize(
    "text,field",
    [
        ("{", "chaos_plan"),
        ("{}", "chaos_plan"),
        ("[1]", r"chaos_plan\[0\]"),
        ('[{"at": 1, "kind": "explode", "learner": 0}]', "chaos.kind"),
        ('[{"at": 1, "kind": "crash"}]', r"chaos_plan\[0\]"),
    ],
)
def test_bad_plans_name_the_field(tmp_path, text, field):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=field):
        load_plan(path)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"mtbi_hours": -1}, "chaos_gen.mtbi_hours"),
        ({"chips_per_learner": 0}, "chaos_gen.chips_per_learner"),
        ({"time_scale": 0}, "chaos_gen.time_scale"),
    ],
)
def test_bad_generators_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ChaosGenerators(**kwargs)
