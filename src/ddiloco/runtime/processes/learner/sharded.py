"""A sharded (FSDP) learner's own parts: its answers put together, its state as plain
tensors, and its recovery shard to shard.

Each rank of a sharded learner holds its rows of every parameter (core/shards.py), and its
rows of the optimizer's moments. Its snapshot for a newcomer is those local tensors (no
DTensor crosses a socket: the newcomer's own mesh and placements wrap them again,
:func:`global_tree`). Every rank serves its own snapshot on its own server, and the ranks
take their snapshots at the same step boundary (any rank asked: every rank takes one), so
rank r of a newcomer copies rank r of one donor, all ranks at once. The newcomer's ranks
then agree that every rank's copy arrived and that all hold the same step and fragment
versions — one donor, one moment — before any of them adopts it; otherwise they try the
next donor, and with none left start from the syncer's global fragments.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ddiloco.runtime.processes.learner.peer import PeerError
from ddiloco.runtime.processes.learner.peer_copy import Copied, fetch_snapshot
from ddiloco.runtime.processes.learner.ranks import RankGroup

log = logging.getLogger(__name__)


def local_tree(tree: Any, copy: bool = True) -> Any:
    """``tree`` with every DTensor replaced by this rank's local tensor (cloned if ``copy``;
    plain tensors are cloned too, so a copy shares nothing with the live state)."""
    if isinstance(tree, DTensor):
        local = tree.to_local()
        return local.detach().to("cpu", copy=True) if copy else local
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True) if copy else tree
    if isinstance(tree, dict):
        return {k: local_tree(v, copy) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(local_tree(v, copy) for v in tree)
    return tree


def _like(value: Any, own: torch.Tensor) -> Any:
    """``value`` (a rank's local tensor) as a DTensor sharded like ``own``, where ``own`` is
    one and ``value`` has its local shape; anything else as it is."""
    if not (isinstance(own, DTensor) and isinstance(value, torch.Tensor)):
        return value
    local = own.to_local()
    if tuple(value.shape) != tuple(local.shape):
        return value  # (refused by load_state_dict, naming the parameter)
    return DTensor.from_local(
        value.to(local.device, local.dtype),
        own.device_mesh,
        own.placements,
        run_check=False,
        shape=own.shape,
        stride=own.stride(),
    )


def global_tree(trainer: dict[str, Any], model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """A copied trainer state of local tensors, made loadable by this rank's sharded
    ``model`` and ``optimizer``: each parameter, and each moment of the optimizer's state,
    wrapped again as a DTensor placed like the parameter it belongs to."""
    own = model.state_dict()
    out = dict(trainer)
    out["model"] = {k: _like(v, own[k]) if k in own else v for k, v in trainer["model"].items()}
    state = trainer.get("optimizer")
    if isinstance(state, dict) and isinstance(state.get("state"), dict):
        moments = dict(state["state"])
        groups = state.get("param_groups", [])
        for group, received in zip(optimizer.param_groups, groups, strict=False):
            for param, pid in zip(group["params"], received.get("params", []), strict=False):
                if isinstance(moments.get(pid), dict):
                    moments[pid] = {k: _like(v, param) for k, v in moments[pid].items()}
        out["optimizer"] = {**state, "state": moments}
    return out


def rows_refusal(tree: Any, rows: dict[str, tuple[int, ...]]) -> str | None:
    """Why a peer rank's snapshot cannot be this rank's, or None: it must hold every
    parameter with this rank's rows' shape (a peer of another rank count, a foreign model,
    or a lying one would otherwise fail the load after the ranks agreed)."""
    try:
        held = tree["trainer"]["model"]
        for name, shape in rows.items():
            have = tuple(held[name].shape)
            if have != shape:
                return f"its {name!r} has shape {have}; this rank holds {shape}"
    except (KeyError, TypeError, AttributeError) as exc:
        return f"its snapshot lacks a parameter's rows ({exc})"
    return None


def _key(copied: Copied | None, fragments: int) -> list[int]:
    """[arrived, step, fragment versions...]: what every rank's copy must agree on."""
    try:
        if copied is not None:
            versions = [int(v) for v in copied.tree["sync"]["versions"]]
            step = int(copied.tree["trainer"]["steps"])
            if len(versions) == fragments:
                return [1, step, *versions]
    except (KeyError, TypeError, ValueError):
        pass
    return [0, -1, *([-1] * fragments)]


def copy_shards(
    ranks: RankGroup,
    donors: Sequence[tuple[str, str]],
    fragments: int,
    run: str,
    secret: bytes,
    learner: int,
    *,
    max_bytes: int,
    refuse: Callable[[Copied], str | None],
) -> tuple[str, Copied, int] | None:
    """Every rank: copy rank ``rank`` of the first donor whose every rank delivers a
    snapshot of the same step and versions (``donors``: rank 0's, the syncer's (learner,
    addresses) of donors with one address per rank; the others pass none). Returns
    (donor, this rank's copy, the bytes all ranks copied), or None when no donor did."""
    shared = ranks.share_bytes(json.dumps(list(donors)).encode() if ranks.leader else None)
    order = [(str(pid), str(where)) for pid, where in json.loads(shared)]
    for pid, where in order:
        addresses = where.split()
        label = f"learner {learner} rank {ranks.rank}"
        copied: Copied | None = None
        try:
            copied = fetch_snapshot(
                addresses[ranks.rank], run, secret, learner, max_bytes=max_bytes, label=label
            )
        except PeerError as exc:
            log.warning("%s: peer %s's rank %d failed: %s", label, pid, ranks.rank, exc)
        if copied is not None and (why := refuse(copied)) is not None:
            log.warning("%s: peer %s's rank %d refused: %s", label, pid, ranks.rank, why)
            copied = None
        key = _key(copied, fragments)
        rows = ranks.all_ints([*key, copied.nbytes if copied is not None else 0])
        if all(row[:-1] == rows[0][:-1] and row[0] for row in rows) and copied is not None:
            log.info(
                "%s: copied rank %d of peer %s (%.1f MB in %.1f s, step %d)",
                label,
                ranks.rank,
                pid,
                copied.nbytes / 1e6,
                copied.seconds,
                key[1],
            )
            return pid, copied, sum(row[-1] for row in rows)
        if ranks.leader:
            said = ", ".join(
                f"rank {r}: " + (f"step {row[1]}" if row[0] else "failed")
                for r, row in enumerate(rows)
            )
            log.warning(
                "learner %d: peer %s's ranks did not deliver one state (%s): next", learner, pid,
                said,
            )  # fmt: skip
    return None
