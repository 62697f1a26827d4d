"""Which GPUs each learner slot gets: never two learners on one device.

A launcher on a host with several GPUs gives learner slot ``m`` its own devices through
``CUDA_VISIBLE_DEVICES`` (one per rank of a torchrun learner), so each learner's ``cuda`` is
a device nobody else trains on. Without this every learner of a multi-GPU host would pick
GPU 0. A restarted or scavenged slot gets the same devices again: they are the slot's.
Pure bookkeeping over the devices visible to the launcher; the Ray runtime asks Ray for the
same count (``num_gpus``) instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ddiloco.config import RunConfig
from ddiloco.errors import ConfigError

GPU_ENV = "CUDA_VISIBLE_DEVICES"


def uses_cuda(device: str) -> bool:
    """Whether learners of ``train.device`` train on a GPU here (``auto``: when one exists)."""
    if device == "auto":
        import torch

        return bool(torch.cuda.is_available())
    return device.split(":")[0] == "cuda"


def gpus_each(config: RunConfig) -> int:
    """The GPUs one learner takes: none on CPU, else one per rank (``train.gpus_per_learner``
    when set, which must then be that count: a rank trains on one device)."""
    if not uses_cuda(config.train.device):
        return 0
    ranks = config.processes.ranks
    asked = config.train.gpus_per_learner
    if asked not in (0, ranks):
        why = f"each of a learner's {ranks} rank(s) trains on one GPU: use {ranks} (or 0: auto)"
        raise ConfigError("train.gpus_per_learner", asked, why)
    return ranks


def visible_gpus(env: Mapping[str, str]) -> list[str]:
    """The devices this process may hand out: ``CUDA_VISIBLE_DEVICES``'s entries when set
    (indices or UUIDs, as the user gave them), else every GPU torch counts."""
    given = env.get(GPU_ENV)
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def assign_gpus(config: RunConfig, slots: int, visible: Sequence[str]) -> dict[int, str]:
    """Slot -> its ``CUDA_VISIBLE_DEVICES`` value; empty on CPU. Refuses a host with fewer
    devices than slots need, and ``cuda:N`` for more than one learner (it pins them all to
    one device)."""
    each = gpus_each(config)
    if each == 0:
        return {}
    device = config.train.device
    if ":" in device:
        if slots * each > 1:
            why = "pins every learner to one GPU: use 'cuda' (each learner gets its own)"
            raise ConfigError("train.device", device, why)
        index = int(device.split(":")[1])
        if index >= len(visible):
            raise ConfigError("train.device", device, f"this host shows {len(visible)} GPU(s)")
        return {0: visible[index]}
    need = slots * each
    if need > len(visible):
        shown = ", ".join(visible) if visible else "none"
        why = (
            f"{slots} learner slot(s) x {each} GPU(s) need {need} GPUs, one learner per device;"
            f" this host shows {len(visible)} ({GPU_ENV}: {shown})"
        )
        raise ConfigError("train.device", device, why)
    return {m: ",".join(visible[m * each : (m + 1) * each]) for m in range(slots)}


def learner_device(device: str) -> str:
    """``train.device`` as a learner sees it once it has its own devices: ``cuda:N`` is
    the first of them, ``cuda``."""
    return "cuda" if device.startswith("cuda:") else device
