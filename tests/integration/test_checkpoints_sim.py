"""A model comes out of every simulated run: checkpoints of the global model at the right
steps, equal to the run's own evaluation, never changing the run, and the commands that use
them (export, sample, eval); a Hugging Face model round-trips through from_pretrained."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ddiloco import train
from ddiloco.checkpoints.format import equivalent_step, home_of, steps_in
from ddiloco.checkpoints.load import load_checkpoint
from ddiloco.cli import main
from ddiloco.config import RunConfig, load_config
from ddiloco.data.corpus import split_corpus
from ddiloco.launch import run_method
from ddiloco.runtime.run import make_eval_batches
from ddiloco.trainer import evaluate

TOKENS_PER_STEP = 2 * 64  # batch_size x gpt-tiny's context
BASE = [
    "model='gpt-tiny'",
    "methods=['decoupled', 'data_parallel']",
    "train.learners=3",
    "train.batch_size=2",
    "train.tokens=6144",  # 16 equivalent learner steps of 3 x 128 tokens
    "train.eval_every=2000",
    "train.checkpoint_every=2304",  # every 6 equivalent steps
    "sync.fragments=3",
    "sync.sync_every=3",
    "data.eval_batches=1",
    "chaos=[]",
]
CRASH = "chaos=[{at=4.0, kind='crash', learner=1, duration=3.0}]"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict[str, Any], RunConfig]:
    out = tmp_path_factory.mktemp("ckpt") / "run"
    config = load_config(None, BASE)
    train(config, out, quiet=True)
    return out, json.loads((out / "summary.json").read_text()), config


def run_batches(config: RunConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    slots = config.train.learners + config.train.scavenged
    return make_eval_batches(config, split_corpus(config.data.source, slots), 64)


def test_checkpoints_are_written_at_the_right_steps_for_every_method(run):
    out, summary, _ = run
    homes = {"decoupled": out / "checkpoints", "data_parallel": out / "checkpoints/data_parallel"}
    for method, home in homes.items():
        steps = steps_in(home)
        final = json.loads((home / f"step-{steps[-1]}" / "ddiloco.json").read_text())
        assert (
            summary["methods"][method]["checkpoint"]
            == (home / f"step-{steps[-1]}").relative_to(out).as_posix()
        )
        assert steps[:2] == [6, 12], method  # 2304 and 4608 tokens
        assert final["step"] == equivalent_step(final["tokens"], 3, TOKENS_PER_STEP)
        for step in steps:
            manifest = json.loads((home / f"step-{step}" / "ddiloco.json").read_text())
            assert manifest["method"] == method and manifest["step"] == step
            assert manifest["tokens"] // (3 * TOKENS_PER_STEP) == step
    assert steps_in(homes["decoupled"]) == [6, 12, 16]
    assert summary["checkpoint"] == "checkpoints/step-16"


def test_the_last_checkpoint_reloads_to_the_runs_final_eval_loss(run):
    out, summary, config = run
    batches = run_batches(config)
    for method, s in summary["methods"].items():
        loaded = load_checkpoint(out / s["checkpoint"])
        assert loaded.method == method
        assert evaluate(loaded.model, batches) == pytest.approx(s["eval_loss"], abs=1e-4)
        assert loaded.manifest["eval_loss"] == pytest.approx(s["eval_loss"], abs=1e-12)
        assert s["eval_bpb"] == pytest.approx(s["eval_loss"] / 0.6931471805599453)


def test_checkpoints_never_change_the_simulated_run(tmp_path):
    config = load_config(None, [*BASE, CRASH, "train.tokens=3072", "train.checkpoint_every=768"])
    splits = split_corpus(config.data.source, 3)
    evals = make_eval_batches(config, splits, 64)
    for method in config.methods:
        runs = []
        for out in (None, tmp_path / method):
            records: list[dict[str, Any]] = []
            summary = run_method(config, method, splits, evals, records.append, out)
            runs.append((json.dumps(records), {**summary, "checkpoint": None}))
        assert runs[0] == runs[1], method  # every metric, bit for bit
        assert len(steps_in(home_of(tmp_path / method, config, method))) >= 3  # it wrote


def test_export_copies_a_checkpoint_that_loads_as_it_is(run, tmp_path, capsys):
    out, summary, _ = run
    dest = tmp_path / "model"
    assert main(["export", str(out), "--out", str(dest)]) == 0
    assert "step-16" in capsys.readouterr().out
    assert (dest / "model.safetensors").read_bytes() == (
        out / summary["checkpoint"] / "model.safetensors"
    ).read_bytes()
    assert load_checkpoint(dest).step == 16
    assert main(["export", str(out), "--out", str(dest)]) == 2  # not over a model
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert main(["export", str(out), "--step", "7", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--step=7" in err and "decoupled: step 6, 12, 16" in err and "data_parallel" in err
    assert (
        main(
            [
                "export",
                str(out),
                "--method",
                "data_parallel",
                "--step",
                "6",
                "--out",
                str(tmp_path / "dp"),
            ]
        )
        == 0
    )
    assert load_checkpoint(tmp_path / "dp").method == "data_parallel"


def test_sample_prints_text_of_the_asked_length(run, capsys):
    out, _, _ = run
    argv = ["sample", str(out), "--prompt", "ROMEO:", "--tokens", "17", "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert len(first["tokens"]) == 17 and all(0 <= t < 256 for t in first["tokens"])
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == first  # the same seed, the same text
    assert (
        main(["sample", str(out), "--prompt", "ROMEO:", "--tokens", "12", "--temperature", "0"])
        == 0
    )
    text = capsys.readouterr().out
    assert text.startswith("ROMEO:") and len(text.rstrip("\n").encode()) >= len("ROMEO:")


def test_eval_prints_the_loss_of_the_global_model(run, capsys):
    out, summary, _ = run
    assert main(["eval", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert f"eval loss {summary['eval_loss']:.4f} nats/token" in line and "bits/byte" in line
    assert main(["eval", str(out), "--method", "data_parallel", "--json", "--batches", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    dp = summary["methods"]["data_parallel"]
    assert result["eval_loss"] == pytest.approx(dp["eval_loss"], abs=1e-4)
    assert result["method"] == "data_parallel" and result["batches"] == 1


def test_a_hugging_face_model_round_trips_through_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_dir = tmp_path / "gpt2-tiny"
    transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        n_positions=64,
        vocab_size=256,
        bos_token_id=0,
        eos_token_id=0,
    ).save_pretrained(hf_dir)
    overrides = [
        f"model='hf:{hf_dir}'",
        "methods=['decoupled']",
        "train.learners=2",
        "train.batch_size=2",
        "train.tokens=2048",
        "train.eval_every=4000",
        "sync.fragments=3",
        "sync.sync_every=3",
        "data.eval_batches=1",
    ]
    config = load_config(None, overrides)
    out = tmp_path / "run"
    (summary,) = train(config, out, quiet=True)
    ckpt = out / summary["checkpoint"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()  # as it is
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in run_batches(config):
            logits = hf(input_ids=x).logits
            total += float(F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))) * y.numel()
            count += y.numel()
    assert total / count == pytest.approx(summary["eval_loss"], abs=1e-4)
    assert load_checkpoint(ckpt).manifest["kind"] == "hf"


def test_a_bpe_run_keeps_its_tokenizer_and_samples_with_it(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    import random

    words = "the king said that his crown was heavy and all the lords slept under the moon"
    rng = random.Random(0)
    text = "".join(
        " ".join(rng.choice(words.split()) for _ in range(12)) + ".\n" for _ in range(3000)
    )
    (tmp_path / "corpus.txt").write_text(text)
    data = tmp_path / "bpe"
    prepare = ["data", "prepare", "--source", str(tmp_path / "corpus.txt"), "--out", str(data)]
    assert main([*prepare, "--tokenizer", "bpe:300"]) == 0
    overrides = [*BASE, "methods=['decoupled']", "train.tokens=1536", f"data.source='{data}'"]
    (summary,) = train(load_config(None, overrides), tmp_path / "run", quiet=True)
    ckpt = load_checkpoint(tmp_path / "run" / summary["checkpoint"])
    assert (ckpt.path / "tokenizer.json").is_file() and ckpt.tokenizer.vocab_size == 300
    capsys.readouterr()
    assert (
        main(["sample", str(tmp_path / "run"), "--prompt", "the king", "--tokens", "9", "--json"])
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert len(result["tokens"]) == 9 and max(result["tokens"]) < 300
    assert result["text"] == ckpt.tokenizer.decode(result["tokens"])


def test_a_hugging_face_model_on_bpe_data_ends_texts_with_the_tokenizers_end_of_text(tmp_path):
    """A config made for another tokenizer (eos 2, as Llama's) is written with the id that
    ended each document in training, so ``generate`` stops at the end of a text."""
    transformers = pytest.importorskip("transformers")
    words = "the king said that his crown was heavy and all the lords slept under the moon"
    (tmp_path / "corpus.txt").write_text((words + ".\n") * 3000)
    data = tmp_path / "bpe"
    prepare = ["data", "prepare", "--source", str(tmp_path / "corpus.txt"), "--out", str(data)]
    assert main([*prepare, "--tokenizer", "bpe:300"]) == 0
    hf_dir = tmp_path / "gpt2-tiny"
    transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, n_positions=32, vocab_size=300, bos_token_id=1,
        eos_token_id=2,
    ).save_pretrained(hf_dir)  # fmt: skip
    overrides = [
        *BASE, f"model='hf:{hf_dir}'", "methods=['decoupled']", "train.tokens=512",
        f"data.source='{data}'",
    ]  # fmt: skip
    (summary,) = train(load_config(None, overrides), tmp_path / "run", quiet=True)
    ckpt = tmp_path / "run" / summary["checkpoint"]
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert tokenizer.eos_token_id == 0
    assert model.config.eos_token_id == model.generation_config.eos_token_id == 0
    assert model.config.bos_token_id == model.generation_config.bos_token_id == 0
    load_checkpoint(ckpt)  # (the manifest's digests cover the rewritten files)
