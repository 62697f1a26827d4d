"""``ddiloco.Learner`` (learner/own_loop.py) before it connects: its call order, the model and
optimizer it accepts, where it reads its settings from, and ``train.entry``'s refusals — each
a clear error before anything trains. (Training under it, with real processes, a crash and
a freeze: tests/integration/test_own_loop.py.)"""

from __future__ import annotations

import dataclasses
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ddiloco
from ddiloco.config import RunConfig, TrainConfig, load_config, to_toml
from ddiloco.core.fragments import gather
from ddiloco.errors import ConfigError, DDiLoCoError
from ddiloco.launch import check_entry
from ddiloco.models.registry import build_model
from ddiloco.runtime.processes.launcher import preflight
from ddiloco.runtime.processes.learner.own_loop import ENV, Learner, resolve_entry, run_entry
from ddiloco.runtime.run import RunSetup

CONFIG = RunConfig(model="gpt-tiny", runtime="processes", methods=("decoupled",),
                   train=TrainConfig(learners=2))  # fmt: skip
SECRET = os.urandom(32)


def made(model: torch.nn.Module | None = None, **kw: object) -> Learner:
    model = model if model is not None else build_model("gpt-tiny")
    optimizer = kw.pop("optimizer", None) or torch.optim.AdamW(model.parameters())
    given = {"config": CONFIG, "secret": SECRET, "syncer": "127.0.0.1:9", "learner": 0, **kw}
    return Learner(model, optimizer, **given)  # type: ignore[arg-type]


def test_the_public_names_are_the_own_loop_ones():
    assert ddiloco.Learner is Learner
    assert ddiloco.Start.__name__ == "Start"


def test_the_call_order_is_checked_and_each_misuse_says_what_it_was():
    learner = made()
    with pytest.raises(DDiLoCoError, match=r"called before start"):
        learner.step(tokens=64)
    learner.close()  # never started: nothing to say goodbye to
    learner.close()  # (twice is fine)
    with pytest.raises(DDiLoCoError, match=r"after close"):
        learner.step(tokens=64)
    with pytest.raises(DDiLoCoError, match=r"after close"):
        learner.start()


def test_it_starts_from_the_runs_initial_values_whatever_the_callers_init():
    torch.manual_seed(1234)  # another seed than the run's
    model = build_model("gpt-tiny")
    with made(model) as learner:
        reference = RunSetup(CONFIG).model  # what the syncer builds: Theta_0
        for (name, mine), (_, theirs) in zip(
            model.named_parameters(), reference.named_parameters(), strict=True
        ):
            assert torch.equal(mine, theirs), name
        assert learner.id == 0 and learner.config is CONFIG


def test_a_model_that_is_not_the_runs_is_refused_naming_the_parameter():
    with pytest.raises(ConfigError, match=r"has parameter .* of shape .* where the run's model"):
        made(build_model("gpt-300k"))


def test_an_optimizer_whose_state_a_peer_could_not_copy_is_refused_naming_where():
    model = build_model("gpt-tiny")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.param_groups[0]["schedule"] = lambda step: 0.1  # not data: cannot cross the wire
    with pytest.raises(ConfigError, match=r"optimizer.param_groups\[0\].schedule.*cannot copy"):
        made(model, optimizer=optimizer)


def test_a_learner_reads_where_it_connects_from_the_environment(tmp_path, monkeypatch):
    config = tmp_path / "run.toml"
    config.write_text(to_toml(CONFIG), encoding="utf-8")
    monkeypatch.setenv(ENV["config"], str(config))
    monkeypatch.setenv(ENV["set"], '["train.learners=3"]')
    monkeypatch.setenv(ENV["syncer"], "127.0.0.1:9")
    monkeypatch.setenv(ENV["learner"], "2")
    monkeypatch.setenv("DDILOCO_SECRET", os.urandom(32).hex())
    model = build_model("gpt-tiny")
    learner = Learner(model, torch.optim.AdamW(model.parameters()))
    assert learner.id == 2 and learner.config.train.learners == 3
    assert learner.engine.link.address == "127.0.0.1:9"
    learner.close()
    monkeypatch.setenv(ENV["learner"], "3")  # slots 0..2
    with pytest.raises(ConfigError, match=r"DDILOCO_LEARNER.*0..2"):
        Learner(model, torch.optim.AdamW(model.parameters()))
    monkeypatch.setenv(ENV["set"], "train.learners=3")  # not a JSON list
    with pytest.raises(ConfigError, match=r"DDILOCO_SET"):
        Learner(model, torch.optim.AdamW(model.parameters()))
    monkeypatch.delenv(ENV["set"])
    monkeypatch.delenv(ENV["syncer"])
    with pytest.raises(ConfigError, match=r"DDILOCO_SYNCER"):
        Learner(model, torch.optim.AdamW(model.parameters()), learner=0)
    with pytest.raises(ConfigError, match=r"unknown argument"):
        Learner(model, torch.optim.AdamW(model.parameters()), syncr="127.0.0.1:9")


def test_an_entry_point_is_refused_before_anything_trains(tmp_path, monkeypatch):
    (tmp_path / "user_loops.py").write_text(
        textwrap.dedent(
            """
            not_callable = 3

            def forgets():
                return None
            """
        ),
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"module:function"):
        resolve_entry("user_loops")
    with pytest.raises(ConfigError, match=r"cannot import module 'no_such_module'"):
        resolve_entry("no_such_module:main")
    with pytest.raises(ConfigError, match=r"no callable 'not_callable'"):
        resolve_entry("user_loops:not_callable")
    monkeypatch.setenv(ENV["learner"], "0")  # (run_entry sets it: restored after the test)
    with pytest.raises(ConfigError, match=r"returned without starting a ddiloco.Learner"):
        run_entry("user_loops:forgets", {"learner": 0})
    sys.modules.pop("user_loops", None)


def test_train_entry_is_checked_with_the_config():
    with pytest.raises(ConfigError, match=r"train.entry.*module:function"):
        load_config(None, ["train.entry='my_loop'"])
    entry = dataclasses.replace(CONFIG.train, entry="my_loop:main")
    with pytest.raises(ConfigError, match=r"runtime"):  # the simulated clock: ddiloco's loop
        check_entry(dataclasses.replace(CONFIG, runtime="sim", train=entry))
    with pytest.raises(ConfigError, match=r"data_parallel.*fragment methods only"):
        check_entry(
            dataclasses.replace(CONFIG, methods=("decoupled", "data_parallel"), train=entry)
        )
    check_entry(dataclasses.replace(CONFIG, train=entry))  # processes, decoupled: fine


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_an_own_loops_model_without_ddilocos_contract_needs_its_evaluation(monkeypatch):
    """The example's model returns logits only: the launcher's pre-flight refuses it without
    ``train.evaluate`` (saying so), and takes it with the example's evaluation."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    base = ["runtime='processes'", "methods=['decoupled']", "model='own_loop:build_model'",
            "train.entry='own_loop:main'", "train.seq_len=64", "train.learners=2"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"name your own evaluation as train.evaluate"):
        preflight.check(load_config(None, base))
    preflight.check(load_config(None, [*base, "train.evaluate='own_loop:evaluate'"]))
    sys.modules.pop("own_loop", None)


def test_train_evaluate_replaces_the_evaluation_on_either_clock(tmp_path, monkeypatch):
    (tmp_path / "user_evals.py").write_text(
        "def constant(model, batches):\n    return 1.25 + 0 * len(batches)\n\n"
        "def words(model, batches):\n    return 'low'\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(None, ["model='gpt-tiny'", "train.evaluate='user_evals:constant'"])
    setup = RunSetup(config)
    fragments = [gather(setup.plan, p, setup.initial) for p in range(setup.plan.num_fragments)]
    assert setup.eval_loss(fragments) == 1.25
    words = RunSetup(load_config(None, ["model='gpt-tiny'", "train.evaluate='user_evals:words'"]))
    with pytest.raises(ConfigError, match=r"returned str, not a number"):
        words.evaluate(words.model)
    sys.modules.pop("user_evals", None)
