"""``ddiloco data prepare`` on a hostile corpus, each built here: a symlink out of the corpus
is refused naming it (raw training reads by the same rule), links inside are read once,
symlink loops end in a counted skip (no hang), ``--force`` replaces only a prepared
directory, a record's very long line is encoded a batch at a time (bounded memory), and
JSON nested too deeply is one line naming the file and line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

from ddiloco.cli import main
from ddiloco.data.corpus import load_documents
from ddiloco.data.prepare import BATCH_TEXT, ENCODE_PIECE, SplitEncoder, split_document
from ddiloco.data.sources import PIECE, documents
from ddiloco.errors import ConfigError

TEXT = "To be, or not to be, that is the question.\n" * 200


def prepare_ok(source: Path | str, out: Path, *extra: str) -> dict:
    assert main(["data", "prepare", "--source", str(source), "--out", str(out), *extra]) == 0
    return json.loads((out / "meta.json").read_text())


def prepare_error(capsys, source: Path | str, out: Path, *extra: str) -> str:
    """The one error line of a refused prepare (exit 2, no traceback)."""
    capsys.readouterr()
    assert main(["data", "prepare", "--source", str(source), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("ddiloco data: error: "), err
    assert not any("Traceback" in line for line in err)
    return err[-1]


def corpus(tmp_path: Path) -> Path:
    src = tmp_path / "corpus"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text(TEXT)
    (src / "sub" / "b.txt").write_text(TEXT.upper())
    return src


def test_a_symlink_out_of_the_corpus_is_refused_naming_it(tmp_path, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n" * 50)
    src = corpus(tmp_path)
    (src / "sub" / "leak.txt").symlink_to(secret)
    out = tmp_path / "out"
    for source in (src, f"{src}/**/*.txt", f"{src}/sub"):
        line = prepare_error(capsys, source, out)
        assert "leak.txt" in line and "a symlink out of the corpus" in line, line
        assert str(secret) in line and not out.exists()
    with pytest.raises(ConfigError, match="a symlink out of the corpus"):
        load_documents(str(src))  # raw training: the same rule
    (src / "sub" / "leak.txt").unlink()
    (src / "escape").symlink_to(tmp_path)  # a directory outside
    assert "escape" in prepare_error(capsys, src, out)
    # a file named as the source is read wherever it points: the user named it
    assert prepare_ok(secret, out)["documents"] == 1


def test_links_inside_the_corpus_are_read_once_and_the_skip_counted(tmp_path, capsys):
    src = corpus(tmp_path)
    plain = prepare_ok(src, tmp_path / "plain")
    (src / "again.txt").symlink_to(src / "a.txt")  # the same file twice
    (src / "hard.txt").hardlink_to(src / "a.txt")  # and a third time
    (src / "sub2").symlink_to(src / "sub")  # a directory inside: read under its own name
    capsys.readouterr()
    meta = prepare_ok(src, tmp_path / "linked")
    err = capsys.readouterr().err
    assert meta["source"]["blake3"] == plain["source"]["blake3"] and meta["documents"] == 2
    assert meta["skipped_files"] == 3 and err.count("ddiloco: warning: skipping") == 3, err
    assert "sub2: a symlink to a directory (not followed)" in err
    assert "the same file as one read already" in err


def test_symlink_loops_end_in_a_counted_skip_not_a_hang(tmp_path):
    """Each loop below made the old glob walk 2^40 paths; in a subprocess with a timeout, so
    a regression fails instead of hanging the suite."""
    src = corpus(tmp_path)
    (src / "loop1").symlink_to(".")
    (src / "loop2").symlink_to(".")
    (src / "sub" / "up").symlink_to("..")
    (src / "x.txt").symlink_to(src / "y.txt")
    (src / "y.txt").symlink_to(src / "x.txt")
    (src / "gone.txt").symlink_to(src / "nowhere.txt")
    out = tmp_path / "out"
    args = ["data", "prepare", "--source", f"{src}/**", "--out", str(out)]
    code = f"import sys; from ddiloco.cli import main; sys.exit(main({args!r}))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"] == 2 and meta["skipped_files"] == 6, done.stderr
    for name in ("loop1", "loop2", "up"):
        assert f"{name}: a symlink to a directory (not followed)" in done.stderr
    for name in ("x.txt", "y.txt", "gone.txt"):
        assert f"{name}: a dangling or looping symlink" in done.stderr


def test_force_replaces_only_a_prepared_directory(tmp_path, capsys):
    source = tmp_path / "play.txt"
    source.write_text(TEXT)
    home = tmp_path / "home"  # a mistyped --out: somebody's files
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    line = prepare_error(capsys, source, home, "--force")
    assert "is not a prepared token directory (no meta.json)" in line and "home" in line
    (home / "meta.json").write_text('{"format": "something else"}')
    line = prepare_error(capsys, source, home, "--force")
    assert "is not a prepared token directory" in line
    assert (home / "thesis.tex").read_text() == "years of work"
    out = tmp_path / "out"
    prepare_ok(source, out)
    (out / "notes.txt").write_text("mine")  # a prepared directory someone wrote into
    assert "holds 'notes.txt'" in prepare_error(capsys, source, out, "--force")
    (out / "notes.txt").unlink()
    link = tmp_path / "link"
    link.symlink_to(out)
    assert "is a symlink" in prepare_error(capsys, source, link, "--force")
    assert prepare_ok(source, out, "--force")["documents"] == 1  # a prepared one is replaced


class CountingTokenizer:
    """Bytes, with eot 256; records how many characters each call encodes."""

    name = "counting"
    vocab_size = 257
    eot = 256

    def __init__(self) -> None:
        self.calls: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.calls.append(len(text))
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode()

    def save(self, directory: Path) -> None:
        pass


def test_a_very_long_line_is_encoded_a_batch_at_a_time(tmp_path):
    """A 20 MB JSONL record with no line break: the pieces the document hands out, the
    texts given to the tokenizer and the text encoded between two flushes are all bounded;
    the tokens are the text's bytes exactly."""
    line = ("abcdefghij" * 2_000_000) + " é"
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"text": line}) + "\n")
    (doc,) = documents(str(path))
    assert max(len(piece) for piece in doc.pieces()) <= 4 * PIECE
    tok = CountingTokenizer()
    encoder = SplitEncoder(tmp_path / "train.bin", "uint16", tok)  # type: ignore[arg-type]
    flushed: list[int] = []
    flush = encoder.flush

    def counted_flush() -> None:
        flushed.append(sum(len(t) for t in encoder.pending if t is not None))
        flush()

    encoder.flush = counted_flush  # type: ignore[method-assign]
    for split, data in split_document(doc, 0.05, on_char=True):
        if split == 0:
            encoder.add(data)
    encoder.end_document()
    encoder.close()
    assert max(tok.calls) <= 4 * ENCODE_PIECE
    assert len(flushed) > 10 and max(flushed) <= BATCH_TEXT + 4 * ENCODE_PIECE
    train = (tmp_path / "train.bin").read_bytes()
    assert encoder.writer.tokens == len(train) // 2 == sum(tok.calls) + 1  # (+ end of text)


def test_a_very_long_record_prepares_in_bounded_memory(tmp_path):
    """The whole prepare of a 20 MB one-line record (BPE-style encoding through the batch
    path), in a subprocess: its peak RSS grows by under 3x the line (the line itself, as
    read and as parsed, and one batch), not by the ~30x the whole-record encode took."""
    mb = 20
    child = textwrap.dedent(
        f"""
        import json, resource, sys
        from pathlib import Path
        from ddiloco.data import prepare as p
        class Tok:
            name, vocab_size, eot = "hf", 300, 256
            def encode(self, text):
                return [ord(c) & 255 for c in text]
            def save(self, directory):
                pass
        p.make_tokenizer = lambda options, docs: Tok()
        here = Path({str(tmp_path)!r})
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        p.prepare(p.Options(str(here / "big.jsonl"), here / "out"), p.Progress(stream=sys.stderr))
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
        """
    )
    record = {"text": "the quick brown fox " * (mb * 50_000)}
    (tmp_path / "big.jsonl").write_text(json.dumps(record) + "\n")
    done = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    grew_mb = float(done.stdout.strip())
    assert grew_mb < 3 * mb, grew_mb


@pytest.mark.parametrize("depth", [200_000, 5_000])
def test_json_nested_too_deeply_is_one_line_naming_file_and_line(tmp_path, capsys, depth):
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + "[" * depth + "]" * depth + "\n")
    line = prepare_error(capsys, path, tmp_path / "out")
    assert f"{path}:2" in line and "JSON nested too deeply to read" in line, line
    meta_dir = tmp_path / "prepared"
    meta_dir.mkdir()
    (meta_dir / "meta.json").write_text("[" * depth + "]" * depth)
    (meta_dir / "train.bin").write_bytes(b"")
    (tmp_path / "ok.txt").write_text(TEXT)
    line = prepare_error(capsys, tmp_path / "ok.txt", meta_dir, "--force")
    assert "meta.json" in line and "nested too deeply" in line, line


if os.name != "posix":  # (symlinks need privileges elsewhere)
    pytestmark = pytest.mark.skip("POSIX only")
