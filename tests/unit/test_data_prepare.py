"""``ddiloco data prepare``: every source kind, the tokenizers, the directory it writes, a
short training run on a BPE prepared from the built-in corpus, and each bad input's one-line
error. Real files in temporary directories; nothing mocked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ddiloco.cli import main
from ddiloco.data.corpus import BatchStream, eval_batches, load_documents, split_corpus
from ddiloco.data.info import bits_per_byte, read_meta, vocab_size
from ddiloco.data.prepare import Options, prepare
from ddiloco.data.sources import WHOLE_FILE, documents, line_pieces
from ddiloco.data.tokenizer import ByteTokenizer, HFTokenizer, tokenizer_for
from ddiloco.data.tokens import file_entry
from ddiloco.errors import ConfigError

PLAY = load_documents("shakespeare")[0][1]  # one play, ~130 KB


def run_prepare(source: Path | str, out: Path, *extra: str) -> dict:
    args = ["data", "prepare", "--source", str(source), "--out", str(out), *extra]
    assert main(args) == 0
    return json.loads((out / "meta.json").read_text())


def cli_error(capsys, *args: str) -> str:
    """Run ``ddiloco data prepare ARGS``; its one error line (exit status 2)."""
    capsys.readouterr()
    assert main(["data", "prepare", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("ddiloco data: error: "), err
    assert not any("Traceback" in line for line in err)
    return err[-1]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bpe") / "shakespeare-bpe1024"
    run_prepare("shakespeare", out, "--tokenizer", "bpe:1024")
    return out


def test_bpe_directory_layout_and_meta(bpe_dir):
    meta = json.loads((bpe_dir / "meta.json").read_text())
    assert sorted(p.name for p in bpe_dir.iterdir()) == [
        "meta.json",
        "tokenizer.json",
        "train.bin",
        "val.bin",
    ]
    assert meta["vocab_size"] == 1024 and meta["dtype"] == "uint16"
    assert meta["tokenizer"] == "bpe" and meta["eot_token"] == 0
    for split in ("train", "val"):
        tokens = meta[split]["tokens"]
        assert (bpe_dir / f"{split}.bin").stat().st_size == 2 * tokens
        assert meta[split]["text_bytes"] > 2 * tokens  # BPE: several bytes per token
    assert meta["documents"] == len(load_documents("shakespeare"))
    for name, entry in meta["files"].items():
        assert file_entry(bpe_dir / name) == entry
    assert len(meta["source"]["blake3"]) == 64
    ids = np.fromfile(bpe_dir / "val.bin", "<u2")
    assert (ids == 0).sum() == meta["documents"]  # one end-of-text after each document's part
    assert ids.max() < 1024
    assert vocab_size(str(bpe_dir)) == 1024
    ratio = meta["val"]["tokens"] / meta["val"]["text_bytes"]
    assert bits_per_byte(2.0, str(bpe_dir)) == pytest.approx(2.0 / np.log(2) * ratio)


def test_the_tokenizer_round_trips_and_saves(bpe_dir, tmp_path):
    tok = tokenizer_for(bpe_dir)
    assert isinstance(tok, HFTokenizer) and tok.name == "hf" and tok.vocab_size == 1024
    text = "To be, or not to be, that is the question:\nWhether 'tis nobler"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()) // 2 and tok.decode(ids) == text
    ckpt = tmp_path / "checkpoint"  # a checkpoint directory holds just the tokenizer.json
    ckpt.mkdir()
    tok.save(ckpt)
    again = tokenizer_for(ckpt)
    assert again.encode(text) == ids and again.vocab_size == 1024
    assert tokenizer_for(ckpt / "tokenizer.json").encode(text) == ids
    raw = tokenizer_for("shakespeare")
    assert isinstance(raw, ByteTokenizer) and raw.vocab_size == 256 and raw.name == "bytes"
    assert raw.encode("é") == [195, 169] and raw.decode([104, 105, 300]) == "hi"
    raw.save(ckpt / "nothing")  # writes nothing
    assert not (ckpt / "nothing").exists()


def test_the_pieces_a_document_is_encoded_in_give_the_whole_documents_tokens(bpe_dir):
    tok = tokenizer_for(bpe_dir)
    whole = tok.encode(PLAY)
    pieces = [i for piece in line_pieces(PLAY, 4096) for i in tok.encode(piece)]
    assert len(line_pieces(PLAY, 4096)) > 10 and pieces == whole


def test_a_short_run_on_the_bpe_directory_learns(bpe_dir, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--quiet", "--out", str(out), "--set", f'data.source="{bpe_dir}"']
    for item in (
        'model="gpt-tiny"',
        'methods=["decoupled"]',
        "train.learners=2",
        "train.tokens=20000",
        "train.eval_every=10000",
        "data.eval_batches=2",
        "chaos=[]",
    ):
        args += ["--set", item]
    assert main(args) == 0
    evals = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if '"eval"' in line
    ]
    assert evals[0]["loss"] == pytest.approx(np.log(1024), abs=0.3)  # the GPT's vocab is 1024
    assert evals[-1]["loss"] < evals[0]["loss"] - 0.2


def test_bytes_from_a_file_split_exactly_as_raw_text(tmp_path):
    source = tmp_path / "plays.text"
    source.write_text("\n\n".join(t for _, t in load_documents("shakespeare")[:6]))
    meta = run_prepare(source, tmp_path / "bytes")
    assert meta["tokenizer"] == "bytes" and meta["vocab_size"] == 256
    assert not (tmp_path / "bytes" / "tokenizer.json").exists()
    assert meta["train"]["tokens"] == meta["train"]["text_bytes"]
    raw, mapped = split_corpus(str(source), 2), split_corpus(str(tmp_path / "bytes"), 2)
    for a, b in zip(raw.shards, mapped.shards, strict=True):
        assert torch.equal(
            a.windows(torch.tensor([0]), a.numel()), b.windows(torch.tensor([0]), b.numel())
        )
    assert torch.equal(
        eval_batches(raw.eval, 64, 8, 2)[1][0], eval_batches(mapped.eval, 64, 8, 2)[1][0]
    )
    assert isinstance(tokenizer_for(tmp_path / "bytes"), ByteTokenizer)


def test_a_big_file_streams_in_pieces_with_the_same_bytes(tmp_path):
    source = tmp_path / "big.txt"
    repeats = WHOLE_FILE // len(PLAY.encode()) + 2
    with source.open("w", encoding="utf-8") as f:
        for _ in range(repeats):
            f.write(PLAY)
    assert source.stat().st_size > WHOLE_FILE
    [doc] = list(documents(str(source)))
    assert len(list(doc.pieces())) > 1 and doc.text() == source.read_text(encoding="utf-8")
    meta = run_prepare(source, tmp_path / "out")
    size = source.stat().st_size
    assert meta["val"]["tokens"] == int(size * 0.05)
    held = np.fromfile(tmp_path / "out" / "val.bin", "<u2").astype(np.uint8).tobytes()
    assert held == source.read_bytes()[size - int(size * 0.05) :]


def test_jsonl_parquet_and_a_saved_dataset_read_their_text_field(tmp_path):
    pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [PLAY[i : i + 9000] for i in range(0, 90_000, 9000)]
    (tmp_path / "a.jsonl").write_text(
        "".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(texts))
    )
    pq.write_table(pa.table({"body": texts, "id": list(range(10))}), tmp_path / "a.parquet")
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(tmp_path / "hf"))
    metas = [
        run_prepare(tmp_path / name, tmp_path / f"out-{name}", "--text-field", "body")
        for name in ("a.jsonl", "a.parquet", "hf")
    ]
    for meta in metas:
        assert meta["documents"] == 10 and meta["source"]["blake3"] == metas[0]["source"]["blake3"]
        assert meta["train"]["text_bytes"] + meta["val"]["text_bytes"] == sum(
            len(t.encode()) for t in texts
        )
    a, b = (np.fromfile(tmp_path / f"out-{n}" / "train.bin", "<u2") for n in ("a.jsonl", "hf"))
    assert (a == b).all()


def test_a_directory_reads_every_text_file_and_skips_binary_and_hidden_ones(tmp_path, capsys):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.py").write_text(PLAY[:40_000])
    (src / "sub" / "README").write_text(PLAY[40_000:80_000])
    (src / "sub" / "notes.jsonl").write_text(json.dumps({"text": PLAY[80_000:90_000]}) + "\n")
    (src / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0" + bytes(range(256)))
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    capsys.readouterr()
    meta = run_prepare(src, tmp_path / "out")
    err = capsys.readouterr().err
    assert f"skipped 1 binary file in {src} (logo.png)" in err
    assert meta["documents"] == 3
    assert meta["train"]["text_bytes"] + meta["val"]["text_bytes"] == len(PLAY[:90_000].encode())
    # a glob of the same files, and raw training reads the directory by the same rules
    meta2 = run_prepare(f"{src}/**/*[!g]", tmp_path / "glob")
    assert meta2["source"]["blake3"] == meta["source"]["blake3"]
    assert [name for name, _ in load_documents(str(src))] == [
        str(src / "a.py"),
        f"{src / 'sub' / 'README'}",
        f"{src / 'sub' / 'notes.jsonl'}:1",
    ]


def test_many_binary_files_are_one_warning_line_with_their_count_and_a_few_names(tmp_path, capsys):
    src = tmp_path / "src"
    (src / "__pycache__").mkdir(parents=True)
    (src / "a.py").write_text(PLAY[:40_000])
    for n in range(240):
        (src / "__pycache__" / f"m{n:03}.cpython-311.pyc").write_bytes(b"\xa7\r\r\n\0\0" * 9)
    capsys.readouterr()
    meta = run_prepare(src, tmp_path / "out", "--tokenizer", "bpe:300")  # (reads src twice)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    names = ", ".join(f"__pycache__/m{n:03}.cpython-311.pyc" for n in range(3))
    assert warnings == [f"ddiloco: warning: skipped 240 binary files in {src} ({names}, ...)"]
    assert meta["skipped_files"] == 240 and meta["documents"] == 1
    assert [name for name, _ in load_documents(str(src))] == [str(src / "a.py")]  # raw text
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "skipped 240 binary files" in warnings[0]
    capsys.readouterr()
    assert load_documents(f"{src}/**/*.pyc") == []  # a glob: named from its root
    assert f"skipped 240 binary files in {src} ({names}, ...)" in capsys.readouterr().err


def test_bpe_training_is_deterministic(tmp_path):
    source = tmp_path / "play.txt"
    source.write_text(PLAY)
    a = run_prepare(source, tmp_path / "a", "--tokenizer", "bpe:400")
    b = run_prepare(source, tmp_path / "b", "--tokenizer", "bpe:400")
    assert a["files"] == b["files"] and a["vocab_size"] == 400


def test_a_brought_tokenizer_json_is_used_as_it_is(bpe_dir, tmp_path):
    source = tmp_path / "play.txt"
    source.write_text(PLAY)
    meta = run_prepare(source, tmp_path / "out", "--tokenizer", str(bpe_dir / "tokenizer.json"))
    assert meta["tokenizer"] == "hf" and meta["vocab_size"] == 1024 and meta["eot_token"] == 0
    tok = tokenizer_for(tmp_path / "out")
    ids = np.fromfile(tmp_path / "out" / "train.bin", "<u2").tolist()
    assert ids[-1] == 0 and tok.decode(ids[:-1]) == PLAY[: len(tok.decode(ids[:-1]))]


def test_replacing_an_existing_directory_needs_force(tmp_path, capsys):
    source = tmp_path / "play.txt"
    source.write_text(PLAY)
    run_prepare(source, tmp_path / "out")
    line = cli_error(capsys, "--source", str(source), "--out", str(tmp_path / "out"))
    assert "exists and is not empty (--force replaces it)" in line
    run_prepare(source, tmp_path / "out", "--tokenizer", "bpe:300", "--force")
    assert read_meta(tmp_path / "out").vocab_size == 300
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "play.txt"]  # no leftovers


def test_a_failed_prepare_leaves_no_directory(tmp_path, capsys):
    source = tmp_path / "docs.jsonl"
    good = "".join(json.dumps({"text": PLAY[i : i + 5000]}) + "\n" for i in range(0, 50_000, 5000))
    source.write_text(good + "{not json\n")
    line = cli_error(capsys, "--source", str(source), "--out", str(tmp_path / "out"))
    assert "docs.jsonl:11" in line and "not JSON" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--tokenizer", "bpe:10"],
            r"--tokenizer='bpe:10': bpe:VOCAB needs a vocabulary in 257\.\.",
        ),
        (["--tokenizer", "bpe:x"], r"--tokenizer='bpe:x': bpe:VOCAB needs"),
        (["--tokenizer", "sentencepiece"], r"--tokenizer='sentencepiece': no such file"),
        (["--eval-fraction", "0.7"], r"--eval-fraction=0.7"),
    ],
)
def test_bad_options_are_one_line(tmp_path, capsys, args, expected):
    source = tmp_path / "play.txt"
    source.write_text(PLAY)
    line = cli_error(capsys, "--source", str(source), "--out", str(tmp_path / "out"), *args)
    assert __import__("re").search(expected, line), line


def test_bad_sources_are_one_line(tmp_path, capsys, bpe_dir):
    out = str(tmp_path / "out")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.dat").write_bytes(b"\0\1\2")
    cases = {
        str(tmp_path / "nowhere"): "no such file, directory or glob",
        str(tmp_path / "*.nothing"): "the glob matches no files",
        str(tmp_path / "rows.jsonl"): "rows.jsonl:1'?: no text field 'text' \\(has: content\\)",
        str(tmp_path / "empty"): "no text: the documents are empty",
        str(tmp_path / "bin"): "no documents",
        str(bpe_dir): "is already a prepared token directory",
    }
    for source, expected in cases.items():
        line = cli_error(capsys, "--source", source, "--out", out)
        assert __import__("re").search(expected, line), line
        assert not Path(out).exists()
    with pytest.raises(ConfigError, match="no text: the files are empty"):
        split_corpus(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="only binary files"):
        split_corpus(str(tmp_path / "bin"))


def test_parquet_without_the_field_names_the_file(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a" * 100]}), tmp_path / "x.parquet")
    line = cli_error(capsys, "--source", str(tmp_path / "x.parquet"), "--out", str(tmp_path / "o"))
    assert "x.parquet" in line and "no text field 'text' (has: body)" in line


NO_TOKENIZERS = """
import sys
sys.modules["tokenizers"] = None  # as on a machine without the data extra
from ddiloco.cli import main
args = ["--source", sys.argv[1], "--tokenizer", "bpe:300", "--out", sys.argv[2]]
sys.exit(main(["data", "prepare", *args]))
"""


def test_without_the_data_extra_bpe_says_what_to_install_and_bytes_work(tmp_path):
    source = tmp_path / "play.txt"
    source.write_text(PLAY)
    done = subprocess.run(
        [sys.executable, "-c", NO_TOKENIZERS, str(source), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith("pip install 'ddiloco[data]'")
    assert not (tmp_path / "out").exists()
    meta = prepare(Options(str(source), tmp_path / "bytes"))  # bytes need no extra
    assert meta["tokenizer"] == "bytes"


def test_importing_ddiloco_imports_no_optional_data_package():
    code = (
        "import sys, ddiloco.cli, ddiloco.data.corpus, ddiloco.data.prepare, ddiloco.runtime.run\n"
        "print(sorted(m for m in ('tokenizers', 'datasets', 'pyarrow') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_batches_from_a_prepared_directory_are_the_files_tokens(bpe_dir):
    splits = split_corpus(str(bpe_dir), 2)
    ids = np.fromfile(bpe_dir / "train.bin", "<u2")
    x, y = BatchStream(splits.shards[0], 4, 32, seed=0).next()
    assert x.dtype == torch.int64 and x.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
    row = x[0].numpy()
    hits = np.flatnonzero(ids[: len(ids) - 31] == row[0])
    assert any((ids[h : h + 32] == row).all() for h in hits)


def test_out_may_not_hold_or_sit_inside_a_source_directory(tmp_path, capsys):
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text(PLAY)
    line = cli_error(capsys, "--source", str(src), "--out", str(src / "tokens"))
    assert "is inside the source directory" in line
    line = cli_error(capsys, "--source", str(src), "--out", str(tmp_path), "--force")
    assert "holds the source" in line
    assert (src / "a.txt").read_text() == PLAY
