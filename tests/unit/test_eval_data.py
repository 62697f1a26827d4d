"""``ddiloco eval --data`` on raw text and prepared directories, with the checkpoint's own
tokenizer, and the tokenizer files transformers reads beside a checkpoint (issue 33). A
real BPE trained by ``data prepare`` on a real file; checkpoints written as runs write them."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ddiloco.checkpoints.load import load_checkpoint
from ddiloco.checkpoints.write import write_checkpoint
from ddiloco.cli import main
from ddiloco.config import load_config
from ddiloco.data.encode import every_window
from ddiloco.data.tokenizer import ByteTokenizer, tokenizer_for, transformers_files
from ddiloco.models.registry import build_model

pytest.importorskip("tokenizers")

WORDS = ["the", "king", "said", "that", "his", "crown", "was", "heavy", "and", "all", "lords"]


def corpus(seed: int, lines: int) -> str:
    rng = random.Random(seed)
    return "".join(" ".join(rng.choice(WORDS) for _ in range(12)) + ".\n" for _ in range(lines))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> tuple[Path, Path]:
    """(a prepared BPE directory, a checkpoint of a gpt-tiny trained on it: its weights
    random, its files as a run writes them)."""
    root = tmp_path_factory.mktemp("bpe")
    (root / "corpus.txt").write_text(corpus(0, 3000))
    data = root / "data"
    argv = ["data", "prepare", "--source", str(root / "corpus.txt"), "--out", str(data)]
    assert main([*argv, "--tokenizer", "bpe:300"]) == 0
    config = load_config(None, ["model='gpt-tiny'", f"data.source='{data}'"])
    torch.manual_seed(0)
    model = build_model(config.model, config)
    ckpt = write_checkpoint(
        root / "step-1",
        model,
        config,
        tokenizer_for(data),
        method="decoupled",
        step=1,
        tokens=1000,
        eval_loss=5.0,
    )
    return data, ckpt


def eval_json(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert main(["eval", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def loss_of(ckpt: Path, ids: list[int]) -> float:
    """The model's mean loss predicting ids[1:] from what precedes each, in the model's
    context-length pieces: by hand, not through every_window."""
    loaded = load_checkpoint(ckpt)
    block = loaded.model.config.block_size
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, block):
            piece = torch.tensor(ids[start : start + block + 1])[None]
            logits, _ = loaded.model(piece[:, :-1])
            target = piece[:, 1:]
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
            total += float(loss) * target.numel()
            count += target.numel()
    return total / count


def test_an_exported_bpe_checkpoint_names_its_end_of_text_token_for_transformers(
    bpe, tmp_path, capsys
):
    transformers = pytest.importorskip("transformers")
    _, ckpt = bpe
    out = tmp_path / "exported"
    assert main(["export", str(ckpt), "--out", str(out)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert tok.bos_token == "<|endoftext|>" and tok.pad_token is None
    assert tok.model_max_length == load_checkpoint(out).model.config.block_size
    text = "the king said that his crown was heavy"
    ours = tokenizer_for(out)
    assert tok(text).input_ids == ours.encode(text)  # nothing added: as the model trained
    assert tok.decode([*ours.encode(text), 0]) == text + "<|endoftext|>"
    manifest = json.loads((out / "ddiloco.json").read_text())
    assert {"tokenizer_config.json", "special_tokens_map.json"} <= set(manifest["files"])


def test_byte_tokens_have_no_tokenizer_files_and_no_end_of_text():
    assert transformers_files(ByteTokenizer(), 64) == {}


def test_eval_data_tokenizes_raw_text_with_the_checkpoints_tokenizer(bpe, tmp_path, capsys):
    _, ckpt = bpe
    text = corpus(1, 40)  # text the tokenizer never saw
    (tmp_path / "other.txt").write_text(text)
    result = eval_json(capsys, str(ckpt), "--data", str(tmp_path / "other.txt"))
    ids = [*tokenizer_for(ckpt).encode(text), 0]  # the document, then end-of-text
    assert result["tokens"] == len(ids) - 1 and result["complete"]  # every token predicted
    assert result["text_bytes"] == len(text.encode())
    assert result["eval_loss"] == pytest.approx(loss_of(ckpt, ids), rel=1e-5)
    bpb = result["eval_loss"] / math.log(2) * len(ids) / len(text.encode())
    assert result["eval_bpb"] == pytest.approx(bpb)
    assert main(["eval", str(ckpt), "--data", str(tmp_path / "other.txt")]) == 0
    line = capsys.readouterr().out
    assert f"on {len(ids) - 1:,} tokens: all of {tmp_path / 'other.txt'}" in line
    assert "1 document," in line and "the checkpoint's tokenizer.json (vocab 300)" in line


def test_the_held_out_part_of_raw_text_is_the_val_file_data_prepare_writes(bpe, tmp_path, capsys):
    _, ckpt = bpe
    for n in range(3):
        (tmp_path / "docs").mkdir(exist_ok=True)
        (tmp_path / "docs" / f"{n}.txt").write_text(corpus(10 + n, 200))
    prepared = tmp_path / "prepared"
    argv = ["data", "prepare", "--source", str(tmp_path / "docs"), "--out", str(prepared)]
    assert main([*argv, "--tokenizer", str(ckpt / "tokenizer.json")]) == 0
    raw = eval_json(capsys, str(ckpt), "--data", str(tmp_path / "docs"), "--held-out")
    val = eval_json(capsys, str(ckpt), "--data", str(prepared))
    assert (
        raw["tokens"]
        == val["tokens"]
        == json.loads((prepared / "meta.json").read_text())["val"]["tokens"] - 1
    )
    assert raw["eval_loss"] == val["eval_loss"] and raw["eval_bpb"] == val["eval_bpb"]
    assert raw["what"].startswith("the last 5% of every document")
    assert val["what"] == f"the held-out split (val.bin) of {prepared}"
    whole = eval_json(capsys, str(ckpt), "--data", str(tmp_path / "docs"))
    assert whole["tokens"] > 15 * raw["tokens"]  # all of it, not its held-out 5%


def test_max_tokens_and_batches_bound_the_tokens_and_say_so(bpe, tmp_path, capsys):
    data, ckpt = bpe
    (tmp_path / "t.txt").write_text(corpus(2, 100))
    result = eval_json(capsys, str(ckpt), "--data", str(tmp_path / "t.txt"), "--max-tokens", "100")
    assert result["tokens"] == 100 and not result["complete"]
    ids = tokenizer_for(ckpt).encode(corpus(2, 100))[:101]
    assert result["eval_loss"] == pytest.approx(loss_of(ckpt, ids), rel=1e-5)
    assert main(["eval", str(ckpt), "--data", str(tmp_path / "t.txt"), "--max-tokens", "100"]) == 0
    assert f"on 100 tokens: the first 100 of {tmp_path / 't.txt'} (--max-tokens 100)" in (
        capsys.readouterr().out
    )
    block = load_checkpoint(ckpt).model.config.block_size
    result = eval_json(capsys, str(ckpt), "--data", str(data), "--batches", "1")
    assert result["tokens"] == 16 * block and result["batches"] == 1
    assert result["what"].startswith(f"the first {16 * block:,} of the held-out split")


def test_a_byte_checkpoint_evaluates_raw_text_as_bytes_and_refuses_bpe_tokens(
    bpe, tmp_path, capsys
):
    data, _ = bpe
    config = load_config(None, ["model='gpt-tiny'"])
    torch.manual_seed(0)
    ckpt = write_checkpoint(
        tmp_path / "step-1",
        build_model(config.model, config),
        config,
        ByteTokenizer(),
        method="decoupled",
        step=1,
        tokens=1000,
        eval_loss=5.0,
    )
    text = "Ünïcode: " + corpus(3, 20)
    (tmp_path / "t.txt").write_text(text)
    result = eval_json(capsys, str(ckpt), "--data", str(tmp_path / "t.txt"))
    ids = list(text.encode())  # bytes: no end-of-text
    assert result["tokens"] == len(ids) - 1
    assert result["eval_loss"] == pytest.approx(loss_of(ckpt, ids), rel=1e-5)
    assert result["eval_bpb"] == pytest.approx(result["eval_loss"] / math.log(2))
    capsys.readouterr()
    assert main(["eval", str(ckpt), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert "tokenized as hf (vocab 300), the model as bytes (vocab 256)" in err
    assert "give the raw text instead" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--max-tokens", "10"], "--max-tokens=10: applies to --data"),
        (["--held-out"], "--held-out=True: applies to --data"),
        (["--data", "X", "--max-tokens", "0"], "--max-tokens=0: must be >= 1"),
    ],
)
def test_bounds_without_data_are_refused_naming_them(bpe, capsys, argv, needle):
    _, ckpt = bpe
    capsys.readouterr()
    assert main(["eval", str(ckpt), *argv]) == 2
    assert needle in capsys.readouterr().err


def test_too_little_text_is_one_line(bpe, tmp_path, capsys):
    _, ckpt = bpe
    (tmp_path / "empty.txt").write_text("")
    capsys.readouterr()
    assert main(["eval", str(ckpt), "--data", str(tmp_path / "empty.txt")]) == 2
    err = capsys.readouterr().err
    assert "too little to evaluate" in err and "Traceback" not in err


def test_every_window_predicts_every_token_once():
    tokens = torch.arange(1000)
    batches = list(every_window(tokens, 64, 4))
    assert all(torch.equal(x + 1, y) for x, y in batches)  # y is the token after x
    assert torch.equal(torch.cat([y.reshape(-1) for _, y in batches]), torch.arange(1, 1000))
    assert [len(x) for x, _ in batches] == [4, 4, 4, 3, 1] and batches[-1][0].shape[1] == 39
    bounded = list(every_window(tokens, 64, 4, limit=100))
    assert torch.equal(torch.cat([y.reshape(-1) for _, y in bounded]), torch.arange(1, 101))


def test_a_directory_prepared_with_another_bpe_of_the_same_size_is_refused(bpe, tmp_path, capsys):
    _, ckpt = bpe
    (tmp_path / "other.txt").write_text("".join(reversed(corpus(5, 3000))) + corpus(6, 500))
    other = tmp_path / "other"
    argv = ["data", "prepare", "--source", str(tmp_path / "other.txt"), "--out", str(other)]
    assert main([*argv, "--tokenizer", "bpe:300"]) == 0
    capsys.readouterr()
    assert main(["eval", str(ckpt), "--data", str(other)]) == 2
    err = capsys.readouterr().err
    assert "(another tokenizer.json of that size)" in err and "give the raw text" in err
    assert main(["eval", str(ckpt), "--data", str(tmp_path / "other.txt"), "--json"]) == 0
