"""The byte format of a learner's state snapshot or a checkpoint: a nested structure of plain
values and tensors, as msgpack plus raw tensor bytes, never pickle."""

from __future__ import annotations

from typing import Any

import msgpack
import torch

from ddiloco.errors import ConfigError

# -- snapshots: nested plain values and tensors <-> bytes -------------------------------------
_TENSOR = "__tensor__"
_TUPLE = "__tuple__"


def pack_tree(tree: Any) -> bytes:
    """Serialize dicts/lists/tuples of scalars, strings and tensors (any dtype)."""
    blobs: list[bytes] = []
    specs: list[list[Any]] = []

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            t = node.detach().to("cpu").contiguous()
            specs.append([str(t.dtype).removeprefix("torch."), list(t.shape)])
            blobs.append(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            return {_TENSOR: len(specs) - 1}
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, tuple):
            return {_TUPLE: [walk(v) for v in node]}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    structure = walk(tree)
    head = msgpack.packb(
        {"tree": structure, "tensors": specs, "sizes": [len(b) for b in blobs]},
        use_bin_type=True,
    )
    return bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def unpack_tree(data: bytes | memoryview) -> Any:
    """Inverse of :func:`pack_tree`; tensors come back as fresh, writable CPU tensors."""
    view = memoryview(data)
    n = int.from_bytes(view[:8], "little")
    head = msgpack.unpackb(view[8 : 8 + n], raw=False, strict_map_key=False)
    tensors: list[torch.Tensor] = []
    pos = 8 + n
    for (dtype_name, shape), size in zip(head["tensors"], head["sizes"], strict=True):
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError("snapshot.dtype", dtype_name, "unknown tensor dtype")
        raw = bytearray(view[pos : pos + size])
        pos += size
        flat = (
            torch.frombuffer(raw, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        )
        tensors.append(flat.view(dtype).reshape(shape) if size else torch.empty(shape, dtype=dtype))

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if set(node) == {_TENSOR}:
                return tensors[node[_TENSOR]]
            if set(node) == {_TUPLE}:
                return tuple(walk(v) for v in node[_TUPLE])
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(head["tree"])
