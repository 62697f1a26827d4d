"""Each learner slot's own GPUs (launcher/devices.py), and the launcher handing them out.

No GPU is needed: the devices are the entries of ``CUDA_VISIBLE_DEVICES`` the launcher sees,
and what is checked is which of them each learner process is given.
"""

from __future__ import annotations

import pytest

from ddiloco.config import load_config
from ddiloco.errors import ConfigError
from ddiloco.runtime.processes.launcher.devices import (
    GPU_ENV,
    assign_gpus,
    gpus_each,
    learner_device,
    visible_gpus,
)
from ddiloco.runtime.processes.launcher.fragments import Launcher


def config(*overrides: str):
    return load_config(None, ["runtime='processes'", "methods=['decoupled']", *overrides])


def test_cpu_learners_get_no_gpu():
    assert gpus_each(config("train.device='cpu'")) == 0
    assert assign_gpus(config("train.device='cpu'"), 4, ["0", "1"]) == {}


def test_every_slot_gets_its_own_device_scavenged_ones_too():
    c = config("train.device='cuda'", "train.learners=3", "train.scavenged=1")
    assert assign_gpus(c, 4, ["0", "1", "2", "3", "4"]) == {0: "0", 1: "1", 2: "2", 3: "3"}


def test_a_torchrun_learner_gets_one_device_per_rank():
    c = config("train.device='cuda'", "train.learners=2", "processes.ranks=2")
    assert gpus_each(c) == 2
    assert assign_gpus(c, 2, ["a", "b", "c", "d"]) == {0: "a,b", 1: "c,d"}


def test_too_few_gpus_are_refused_naming_the_count():
    c = config("train.device='cuda'", "train.learners=4")
    with pytest.raises(ConfigError, match=r"4 learner slot\(s\) x 1 GPU\(s\) need 4 GPUs.*shows 2"):
        assign_gpus(c, 4, ["0", "1"])


def test_a_pinned_device_is_refused_for_several_learners_and_mapped_for_one():
    with pytest.raises(ConfigError, match="pins every learner to one GPU"):
        assign_gpus(config("train.device='cuda:1'"), 2, ["0", "1"])
    assert assign_gpus(config("train.device='cuda:1'", "train.learners=1"), 1, ["5", "7"]) == {
        0: "7"
    }
    assert learner_device("cuda:1") == "cuda"
    assert learner_device("cpu") == "cpu"


def test_gpus_per_learner_must_match_the_ranks():
    with pytest.raises(ConfigError, match="each of a learner's 1 rank"):
        gpus_each(config("train.device='cuda'", "train.gpus_per_learner=2"))
    assert gpus_each(config("train.device='cuda'", "train.gpus_per_learner=1")) == 1


def test_visible_devices_are_the_users_when_set():
    assert visible_gpus({GPU_ENV: "GPU-aa, GPU-bb"}) == ["GPU-aa", "GPU-bb"]
    assert visible_gpus({GPU_ENV: ""}) == []


def test_the_launcher_starts_each_learner_on_its_own_devices(tmp_path, monkeypatch):
    monkeypatch.setenv(GPU_ENV, "4,5,6,7")
    c = config("train.device='cuda:0'", "train.learners=1")
    with pytest.raises(ConfigError, match=r"need 5 GPUs.*shows 4"):  # one learner per device
        Launcher(config("train.device='cuda'", "train.learners=5"), "decoupled", tmp_path, print)
    launcher = Launcher(
        config("train.device='cuda'", "train.learners=3"), "decoupled", tmp_path, print
    )
    spawned = {}
    monkeypatch.setattr(
        launcher, "_spawn", lambda name, args, control=False, env=None: spawned.update({name: env})
    )
    for m in range(3):
        launcher.start_learner(m)
    launcher.start_learner(1, join=True)  # a restart keeps the slot's device
    assert spawned == {f"learner-{m}": {GPU_ENV: str(4 + m)} for m in range(3)}
    assert 'device = "cuda"' in launcher.config_path.read_text()
    assert Launcher(c, "decoupled", tmp_path / "one", print).gpus == {0: "4"}
