"""Checkpoint directories without a run: written, loaded back, damage refused naming the
file, and never a half directory named step-N."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ddiloco.checkpoints.format import MANIFEST, CheckpointError, steps_in
from ddiloco.checkpoints.load import find_checkpoint, load_checkpoint, verify
from ddiloco.checkpoints.write import publish, sweep, write_checkpoint
from ddiloco.cli import main
from ddiloco.config import load_config, to_toml
from ddiloco.data.tokenizer import ByteTokenizer
from ddiloco.models.gpt import GPT, GPT_CONFIGS

CONFIG = load_config(None, ["model='gpt-tiny'", "methods=['decoupled', 'data_parallel']"])


def written(home: Path, step: int = 3, seed: int = 0) -> tuple[Path, GPT]:
    torch.manual_seed(seed)
    model = GPT(GPT_CONFIGS["gpt-tiny"])
    path = write_checkpoint(
        home / f"step-{step}",
        model,
        CONFIG,
        ByteTokenizer(),
        method="decoupled",
        step=step,
        tokens=step * 1000,
        eval_loss=2.5,
    )
    return path, model


def test_a_checkpoint_loads_back_the_same_model_and_says_what_it_is(tmp_path):
    path, model = written(tmp_path)
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        MANIFEST,
        "model.safetensors",
        "run.toml",
    ]
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["method"] == "decoupled" and manifest["step"] == 3
    assert manifest["tokens"] == 3000 and manifest["eval_loss"] == 2.5
    assert manifest["eval_bpb"] == pytest.approx(2.5 / 0.6931471805599453)
    assert manifest["kind"] == "gpt" and manifest["model"] == "gpt-tiny"
    assert set(manifest["files"]) == {"config.json", "model.safetensors", "run.toml"}
    assert all(len(f["blake3"]) == 64 for f in manifest["files"].values())
    with safe_open(str(path / "model.safetensors"), "pt") as f:  # plain safetensors
        assert set(f.keys()) == set(model.state_dict())
    loaded = load_checkpoint(path)
    assert loaded.step == 3 and loaded.method == "decoupled"
    assert (path / "run.toml").read_text() == to_toml(CONFIG)
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], value), name
    assert loaded.tokenizer.name == "bytes"


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "name,damage,needle",
    [
        ("model.safetensors", flip, "digest mismatch"),
        ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:-100]), "truncated"),
        ("model.safetensors", Path.unlink, "missing"),
        ("config.json", Path.unlink, "missing"),
        ("run.toml", flip, "digest mismatch"),
        (MANIFEST, Path.unlink, "not a complete ddiloco checkpoint"),
        (MANIFEST, lambda p: p.write_text("{"), "unreadable"),
    ],
)
def test_a_damaged_truncated_or_missing_file_is_refused_naming_it(
    tmp_path, capsys, name, damage, needle
):
    path, _ = written(tmp_path)
    damage(path / name)
    with pytest.raises(CheckpointError) as caught:
        verify(path)
    assert str(path / name) in str(caught.value) and needle in str(caught.value)
    assert main(["eval", str(path)]) == 2  # the command line: one line, no traceback
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path / name) in err and "Traceback" not in err


def test_a_crashed_write_leaves_no_step_directory_and_is_swept(tmp_path):
    path, _ = written(tmp_path, step=3)
    half = tmp_path / ".step-6.abcd1234.tmp"  # what a writer killed mid-write leaves
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"half")
    assert steps_in(tmp_path) == [3]
    assert find_checkpoint(path) == path
    sweep(tmp_path)
    assert not half.exists() and steps_in(tmp_path) == [3]


def test_a_checkpoint_of_the_same_step_replaces_the_old_one_whole(tmp_path):
    old, _ = written(tmp_path, step=3, seed=0)
    new, model = written(tmp_path, step=3, seed=1)  # e.g. the final one after a periodic one
    assert new == old and steps_in(tmp_path) == [3]
    assert [p.name for p in tmp_path.iterdir()] == ["step-3"]  # nothing left aside
    loaded = load_checkpoint(new)
    assert torch.equal(loaded.model.head.weight, model.head.weight)


def test_a_checkpoint_renamed_aside_by_a_crash_is_put_back(tmp_path):
    path, _ = written(tmp_path, step=3)
    aside = tmp_path / ".step-3.0badf00d.old"
    os.rename(path, aside)  # the crash came between publish's two renames
    assert steps_in(tmp_path) == []
    sweep(tmp_path)
    assert steps_in(tmp_path) == [3] and verify(path)["step"] == 3


def test_publish_never_shows_a_half_directory(tmp_path):
    tmp = tmp_path / ".step-1.x.tmp"
    tmp.mkdir()
    (tmp / "a").write_text("complete")
    publish(tmp, tmp_path / "step-1")
    assert (tmp_path / "step-1" / "a").read_text() == "complete" and not tmp.exists()


def test_a_run_without_such_a_step_or_method_lists_what_it_has(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text(to_toml(CONFIG))
    written(run / "checkpoints", step=3)
    written(run / "checkpoints", step=6)
    assert find_checkpoint(run) == run / "checkpoints" / "step-6"
    assert find_checkpoint(run, step=3) == run / "checkpoints" / "step-3"
    with pytest.raises(ValueError, match="there are: decoupled: step 3, 6"):
        find_checkpoint(run, step=4)
    with pytest.raises(ValueError, match="the run has decoupled, data_parallel"):
        find_checkpoint(run, method="streaming")
    with pytest.raises(CheckpointError, match="no checkpoints of data_parallel"):
        find_checkpoint(run, method="data_parallel")
    with pytest.raises(CheckpointError, match="neither a checkpoint"):
        find_checkpoint(tmp_path)


USER_MODELS = """
import os
import pathlib

import torch
from torch import nn

pathlib.Path(os.environ["DDILOCO_TEST_MARKER"]).write_text("imported")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.arange(6.0).reshape(2, 3))


def build():
    return Tiny()
"""


def test_a_checkpoint_of_user_code_never_runs_the_code_it_names(tmp_path, monkeypatch):
    (tmp_path / "usermodels_ckpt.py").write_text(USER_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "imported"
    monkeypatch.setenv("DDILOCO_TEST_MARKER", str(marker))
    config = load_config(None, ["model='usermodels_ckpt:build'"])
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.ones(2, 3))
    path = write_checkpoint(
        tmp_path / "step-1",
        model,
        config,
        ByteTokenizer(),
        method="decoupled",
        step=1,
        tokens=10,
        eval_loss=2.0,
    )
    with pytest.raises(CheckpointError, match="never runs code") as info:
        load_checkpoint(path)
    assert "--model usermodels_ckpt:build" in str(info.value)
    assert not marker.exists()  # refused before anything was imported
    loaded = load_checkpoint(path, builder="usermodels_ckpt:build")  # the user says so
    assert marker.exists() and torch.equal(loaded.model.w, torch.ones(2, 3))


def test_a_run_of_user_code_recovered_from_its_store_never_runs_the_code_it_names(
    tmp_path, monkeypatch
):
    """``ddiloco export RUN --store`` builds the model the store's fragments go into: from a
    run directory whose config names user code, only with the user's ``--model``."""
    from ddiloco.commands.export import pick

    (tmp_path / "usermodels_run.py").write_text(USER_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "imported"
    monkeypatch.setenv("DDILOCO_TEST_MARKER", str(marker))
    run = tmp_path / "run"
    run.mkdir()
    config = load_config(None, ["model='usermodels_run:build'", "methods=['decoupled']"])
    (run / "config.toml").write_text(to_toml(config))
    with pytest.raises(ValueError, match="never runs code it names") as info:
        pick(run, None, None, True)
    assert "pass --model usermodels_run:build" in str(info.value)
    assert not marker.exists()  # refused before anything was imported
    with pytest.raises(CheckpointError, match="no syncer store"):  # past the check: no state
        pick(run, None, None, True, "usermodels_run:build")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weights_holding_nan_or_infinity_are_refused_even_with_the_digests_fixed_up(tmp_path, bad):
    from safetensors.torch import load_file, save_file

    from ddiloco.checkpoints.format import digest

    path, _ = written(tmp_path)
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] = bad
    save_file(tensors, str(weights), metadata={"format": "pt"})
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"]["model.safetensors"] = {
        "bytes": weights.stat().st_size,
        "blake3": digest(weights),
    }
    (path / MANIFEST).write_text(json.dumps(manifest))
    assert verify(path)  # the forger fixed the digests up: the files check out
    with pytest.raises(CheckpointError, match="NaN or infinite") as info:
        load_checkpoint(path)
    assert "model.safetensors" in str(info.value) and name in str(info.value)


def test_in_a_run_holding_its_secret_a_checkpoint_is_authenticated_not_only_digested(tmp_path):
    # the processes' syncer authenticates every manifest under a key derived from the run
    # secret; eval / export / sample of a run that keeps the secret require it (issue 29)
    from safetensors.torch import load_file, save_file

    from ddiloco.checkpoints.format import MAC, digest, manifest_key
    from ddiloco.commands.export import pick
    from ddiloco.runtime.layout import run_secret

    secret = os.urandom(32)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text(to_toml(CONFIG))
    run_secret(run, "decoupled").parent.mkdir(parents=True)
    run_secret(run, "decoupled").write_text(secret.hex() + "\n")
    run_secret(run, "decoupled").chmod(0o600)
    torch.manual_seed(0)
    model = GPT(GPT_CONFIGS["gpt-tiny"])
    path = write_checkpoint(run / "checkpoints" / "step-3", model, CONFIG, ByteTokenizer(),
                            method="decoupled", step=3, tokens=3000, eval_loss=2.5,
                            key=manifest_key(secret))  # fmt: skip
    source = pick(run, None, None, False)
    assert source.checkpoint == path and source.key == manifest_key(secret)
    assert load_checkpoint(path, key=source.key).step == 3
    # a forger scales the weights by 1e4 (finite: no other check sees it) and fixes the
    # digests up: the files check out, the manifest's MAC does not
    weights = path / "model.safetensors"
    tensors = {k: v * 1e4 for k, v in load_file(str(weights)).items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"]["model.safetensors"] = {"bytes": weights.stat().st_size,
                                              "blake3": digest(weights)}  # fmt: skip
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="MAC does not verify") as info:
        load_checkpoint(path, key=source.key)
    assert MANIFEST in str(info.value)
    del manifest[MAC]  # ... or drops the MAC: a run whose checkpoints carry one refuses that
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="no MAC, in a run whose checkpoints carry one"):
        load_checkpoint(path, key=source.key)
    another, _ = written(tmp_path / "elsewhere")  # another run's (unkeyed) checkpoint, copied in
    (run / "checkpoints" / "step-3").rename(tmp_path / "tampered")
    another.rename(run / "checkpoints" / "step-3")
    with pytest.raises(CheckpointError, match="no MAC"):
        load_checkpoint(pick(run, None, None, False).checkpoint, key=source.key)
    # out of a run, no secret is at hand: the digests alone check a checkpoint
    assert load_checkpoint(tmp_path / "tampered").step == 3
