"""examples/decoupled_by_hand.py: the core driven by hand trains, balances its ledger, and
shows what the grace window does for a learner that is twice as slow."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "decoupled_by_hand.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("decoupled_by_hand", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_the_global_model_learns_and_the_ledger_balances(example: ModuleType) -> None:
    result = example.main(steps=60, verbose=False)
    assert result["eval_after"] < result["eval_before"] - 1.0  # from ~5.5 nats (uniform bytes)
    assert result["balanced"]
    assert 0.5 < result["token_efficiency"] < 1.0  # overlap overwrites some progress
    assert result["counts"]["merged_rounds"] > 0
    # with the grace window the slow learner makes every round: nothing waits
    assert result["counts"].get("waiting", 0) == 0


def test_without_grace_the_slow_learners_answers_wait_for_the_next_round(
    example: ModuleType,
) -> None:
    result = example.main(steps=40, grace=False, verbose=False)
    assert result["balanced"]
    assert result["counts"]["waiting"] > 0
    assert result["eval_after"] < result["eval_before"]


def test_it_prints_the_losses_and_the_token_efficiency(
    example: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    example.main(steps=16)
    out = capsys.readouterr().out
    assert "eval loss of the global model at the start" in out
    assert "token efficiency" in out and "ledger balanced: True" in out
