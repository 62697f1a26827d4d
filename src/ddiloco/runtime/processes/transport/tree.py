"""The byte format of a learner's state snapshot or a checkpoint: a nested structure of plain
values and tensors, as msgpack plus raw tensor bytes, never pickle.

The stream is an 8-byte little-endian head length, the msgpack head (the tree with each tensor
replaced by its index, and each tensor's dtype, shape and byte size), then every tensor's
bytes in order. :class:`Layout` reads any byte range of that stream straight from the tensors'
storage and :class:`TreeWriter` writes ranges straight into preallocated tensors, so a peer
copy of a 16 GB state never builds a 16 GB blob on either side (docs/decisions.md, "peer
copies of any size"). :func:`pack_tree` / :func:`unpack_tree` are the same format in one piece
(checkpoint files).
"""

from __future__ import annotations

import bisect
import math
from typing import Any, BinaryIO, NoReturn

import msgpack
import torch
from blake3 import blake3

from ddiloco.errors import ConfigError

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
PREFIX = 8  # the head's length, little-endian
MAX_HEAD_BYTES = 64 << 20  # a head larger than this is refused before it is allocated


def _flat(data: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _byte_view(t: torch.Tensor) -> memoryview:
    """A tensor's bytes without a copy (the tensor must be contiguous and on the CPU)."""
    return t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


class Layout:
    """A tree as its byte stream, served as ranges over the tensors' own storage.

    The tensors are taken as they are (moved to the CPU, made contiguous): the caller hands
    over copies nobody else writes (the learner's snapshot is cloned between two steps), so
    the stream is consistent without a second copy. A tensor that appears twice in the tree
    (tied weights) is stored once.
    """

    def __init__(self, tree: Any) -> None:
        self.tensors: list[torch.Tensor] = []
        structure = _index(tree, self.tensors, {})
        specs = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in self.tensors]
        views = [_byte_view(t) for t in self.tensors]
        head = msgpack.packb(
            {"tree": structure, "tensors": specs, "sizes": [v.nbytes for v in views]},
            use_bin_type=True,
        )
        self.head_end = PREFIX + len(head)
        parts = [memoryview(len(head).to_bytes(PREFIX, "little") + head)]
        self.parts = parts + [v for v in views if v.nbytes]
        self.starts: list[int] = []
        pos = 0
        for part in self.parts:
            self.starts.append(pos)
            pos += part.nbytes
        self.size = pos

    def read(self, offset: int, length: int) -> bytes | memoryview:
        """Bytes [offset, offset + length) of the stream (a view when inside one tensor)."""
        end = min(self.size, offset + length)
        if offset < 0 or offset >= end:
            return b""
        i = bisect.bisect_right(self.starts, offset) - 1
        out: list[memoryview] = []
        while offset < end:
            part, start = self.parts[i], self.starts[i]
            take = min(end, start + part.nbytes)
            out.append(part[offset - start : take - start])
            offset, i = take, i + 1
        return out[0] if len(out) == 1 else b"".join(out)

    def digest(self, threads: int = 1) -> str:
        """BLAKE3 of the whole stream (releases the GIL: a server thread computes it)."""
        h = blake3(max_threads=threads)
        for part in self.parts:
            h.update(part)
        return h.hexdigest()


class TreeWriter:
    """Rebuilds a tree from its stream, written in ranges in any order.

    Nothing the sender claims is allocated before it is checked: the head's length against
    ``max_bytes`` and :data:`MAX_HEAD_BYTES`, then (:meth:`parse_head`) every tensor's dtype,
    shape and size, and their sum against the stream's announced size. The tensors are then
    allocated once and written in place. A range must lie wholly inside the head
    ([0, :attr:`head_end`)) or wholly after it.
    """

    def __init__(self, size: int, head_len: int, max_bytes: int, source: str = "snapshot"):
        self.source = source
        if not 0 <= size <= max_bytes:
            self._refuse("size", size, f"limit {max_bytes} bytes")
        if not 0 < head_len <= min(MAX_HEAD_BYTES, size - PREFIX):
            self._refuse("head", head_len, f"must be in (0, {min(MAX_HEAD_BYTES, size - PREFIX)}]")
        self.size = size
        self.head_end = PREFIX + head_len
        self.head = bytearray(self.head_end)
        self.tensors: list[torch.Tensor] = []
        self._views: list[memoryview] = []
        self._starts: list[int] = []
        self._structure: Any = None
        self.parsed = False

    def _refuse(self, field: str, value: Any, why: str) -> NoReturn:
        raise ConfigError(f"{self.source}.{field}", value, why)

    def write(self, offset: int, data: bytes | memoryview) -> None:
        view = _flat(data)
        end = offset + view.nbytes
        if offset < 0 or end > self.size:
            self._refuse("range", (offset, view.nbytes), f"outside the {self.size}-byte stream")
        if end <= self.head_end:
            self.head[offset:end] = view
            return
        if offset < self.head_end or not self.parsed:
            self._refuse("range", (offset, view.nbytes), "crosses the head or precedes it")
        i = bisect.bisect_right(self._starts, offset) - 1
        pos = 0
        while offset < end:
            part, start = self._views[i], self._starts[i]
            take = min(end, start + part.nbytes)
            part[offset - start : take - start] = view[pos : pos + take - offset]
            pos += take - offset
            offset, i = take, i + 1

    def parse_head(self) -> None:
        """Check the head (written in full) and allocate every tensor it describes."""
        n = int.from_bytes(self.head[:PREFIX], "little")
        if n != self.head_end - PREFIX:
            self._refuse("head", n, f"the stream announced {self.head_end - PREFIX}")
        try:
            head = msgpack.unpackb(self.head[PREFIX:], raw=False, strict_map_key=False)
            specs, sizes, structure = head["tensors"], head["sizes"], head["tree"]
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
            self._refuse("head", type(exc).__name__, f"not a snapshot head: {exc}")
        if not isinstance(specs, list) or not isinstance(sizes, list) or len(specs) != len(sizes):
            self._refuse("head", "tensors", "specs and sizes differ in length")
        plan: list[tuple[torch.dtype, list[int], int]] = []
        for spec, size in zip(specs, sizes, strict=True):
            dtype, shape = self._check(spec, size)
            plan.append((dtype, shape, size))
        total = sum(s for _, _, s in plan)
        if self.head_end + total != self.size:
            why = f"the head's tensors need {total} bytes after it; the stream has that many"
            self._refuse("size", self.size - self.head_end, why)
        pos = self.head_end
        for dtype, shape, size in plan:  # every size checked: now allocate
            if not size:
                self.tensors.append(torch.empty(shape, dtype=dtype))
                continue
            raw = torch.empty(size, dtype=torch.uint8)
            self.tensors.append(raw.view(dtype).reshape(shape))
            self._views.append(_byte_view(raw))
            self._starts.append(pos)
            pos += size
        self._structure = structure
        self.parsed = True

    def _check(self, spec: Any, size: Any) -> tuple[torch.dtype, list[int]]:
        ok = isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str)
        ok = ok and isinstance(spec[1], list) and all(type(d) is int and d >= 0 for d in spec[1])
        if not ok or type(size) is not int or size < 0:
            self._refuse("tensor", spec, "not a [dtype, shape] with a size")
        if size > self.size:
            self._refuse("tensor", spec, f"claims {size} bytes; the whole stream is {self.size}")
        dtype = getattr(torch, spec[0], None)
        if not isinstance(dtype, torch.dtype):
            self._refuse("dtype", spec[0], "unknown tensor dtype")
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if math.prod(spec[1]) * itemsize != size:
            self._refuse("tensor", spec, f"its shape does not make {size} bytes")
        return dtype, spec[1]

    def digest(self, threads: int = 1) -> str:
        h = blake3(self.head, max_threads=threads)
        for view in self._views:
            h.update(view)
        return h.hexdigest()

    def fill(self, f: BinaryIO) -> None:
        """Read every tensor's bytes, in order, straight from ``f`` (positioned after the
        head) into the tensors :meth:`parse_head` allocated."""
        if not self.parsed:
            self._refuse("range", self.head_end, "the head is not parsed yet")
        for view in self._views:
            while view:
                got = f.readinto(view)  # type: ignore[attr-defined]
                if not got:
                    self._refuse("size", self.size, "the stream ended inside a tensor")
                view = view[got:]

    def tree(self) -> Any:
        """The rebuilt tree (its tensors are the ones written in place: fresh, writable)."""
        return _rebuild(self._structure, self.tensors, self._refuse)


# (module functions, not closures: a recursive closure is a reference cycle that keeps every
# tensor it saw alive until the cyclic collector runs: gigabytes at gpt-50m, issue 28)
def _index(node: Any, tensors: list[torch.Tensor], seen: dict[int, int]) -> Any:
    """``node`` with each tensor replaced by its index in ``tensors`` (CPU, contiguous; a
    tensor met twice, as tied weights are, is stored once)."""
    if isinstance(node, torch.Tensor):
        if id(node) not in seen:
            seen[id(node)] = len(tensors)
            tensors.append(node.detach().to("cpu").contiguous())
        return {_TENSOR: seen[id(node)]}
    if isinstance(node, dict):
        return {k: _index(v, tensors, seen) for k, v in node.items()}
    if isinstance(node, tuple):
        return {_TUPLE: [_index(v, tensors, seen) for v in node]}
    if isinstance(node, list):
        return [_index(v, tensors, seen) for v in node]
    return node


def _rebuild(node: Any, tensors: list[torch.Tensor], refuse: Any) -> Any:
    if isinstance(node, dict):
        if set(node) == {_TENSOR}:
            i = node[_TENSOR]
            if type(i) is not int or not 0 <= i < len(tensors):
                refuse("tree", i, "refers to no tensor")
            return tensors[i]
        if set(node) == {_TUPLE}:
            return tuple(_rebuild(v, tensors, refuse) for v in node[_TUPLE])
        return {k: _rebuild(v, tensors, refuse) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebuild(v, tensors, refuse) for v in node]
    return node


def pack_tree(tree: Any) -> bytes:
    """Serialize dicts/lists/tuples of scalars, strings and tensors (any dtype)."""
    layout = Layout(tree)
    return b"".join(layout.parts)


def unpack_tree(data: bytes | memoryview) -> Any:
    """Inverse of :func:`pack_tree`; tensors come back as fresh, writable CPU tensors."""
    view = _flat(data)
    if view.nbytes < PREFIX:
        raise ConfigError("snapshot.size", view.nbytes, f"shorter than its {PREFIX}-byte prefix")
    n = int.from_bytes(view[:PREFIX], "little")
    writer = TreeWriter(view.nbytes, n, view.nbytes)
    writer.write(0, view[: writer.head_end])
    writer.parse_head()
    if writer.head_end < view.nbytes:
        writer.write(writer.head_end, view[writer.head_end :])
    return writer.tree()
