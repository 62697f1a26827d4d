"""Hugging Face causal language models as ddiloco models: ``model = "hf:PATH"``.

PATH is a local directory with a transformers ``config.json``: with no weights beside it the
model starts from a random init (``from_config``, seeded by the caller's
``torch.manual_seed``: every process builds the same Theta_0); with weights it starts from them
(``from_pretrained``: continued pre-training). Nothing is downloaded: the path must exist and
every load is ``local_files_only``. Parameters are kept in fp32 whatever the checkpoint's
dtype (training autocasts; the syncer's fragments are fp32).

:class:`HFCausalLM` adapts the HF forward to ddiloco's ``forward(idx, targets) -> (logits,
loss)``. ddiloco's targets are already shifted (``targets[:, i]`` is the token after
``idx[:, i]``), so they are never passed as ``labels`` (HF would shift them again and train
on the token two ahead); the loss is computed here, once.

``transformers`` is an optional extra (``pip install 'ddiloco[hf]'``), imported only when an
``hf:`` model is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ddiloco.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PREFIX = "hf:"
CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")  # start from these
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")  # never unpickled: refused
INSTALL = "pip install 'ddiloco[hf]'"


class HFCausalLM(nn.Module):
    """A transformers causal LM behind ddiloco's model interface. ``hf`` is the
    ``PreTrainedModel`` itself (``model.hf.save_pretrained(dir)`` writes a loadable directory);
    ``config`` is its config, where the run reads the context and the vocabulary."""

    def __init__(self, hf: PreTrainedModel) -> None:
        super().__init__()
        self.hf = hf

    @property
    def config(self) -> Any:
        return self.hf.config

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position, and the mean cross-entropy (nats/token) against the
        already-shifted ``targets`` if given."""
        out = self.hf(input_ids=idx, use_cache=False)
        logits: torch.Tensor = out.logits if hasattr(out, "logits") else out[0]
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def is_hf(name: str) -> bool:
    return name.startswith(PREFIX)


def build_hf(name: str) -> HFCausalLM:
    """The model ``hf:PATH`` names: random init from PATH's config, or PATH's weights."""
    path = Path(name[len(PREFIX) :]).expanduser()
    if not (path / CONFIG_FILE).is_file():
        where = "is not a directory" if not path.is_dir() else f"has no {CONFIG_FILE}"
        raise ConfigError(
            "model", name, f"{str(path)!r} {where} (a local Hugging Face model directory)"
        )
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError("model", name, f"needs transformers: {INSTALL}") from exc
    hf_logging: Any = transformers.utils.logging
    hf_logging.disable_progress_bar()  # a bar per process and load: noise on the terminal
    auto: Any = transformers.AutoModelForCausalLM  # its from_config is untyped
    fp32 = {_dtype_key(transformers.__version__): torch.float32}
    weights = any((path / f).is_file() for f in WEIGHT_FILES)
    if not weights and any((path / f).is_file() for f in PICKLED):
        why = "has pickled weights (pytorch_model.bin), which ddiloco never loads: save them "
        raise ConfigError("model", name, why + "as safetensors (save_pretrained does)")
    try:
        if weights:
            hf = auto.from_pretrained(
                str(path), local_files_only=True, use_safetensors=True, **fp32
            )
        else:
            config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
            hf = auto.from_config(config, **fp32)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, ImportError) as exc:
        raise ConfigError(
            "model", name, f"transformers cannot load it: {_first_line(exc)}"
        ) from exc
    return HFCausalLM(hf)


def _dtype_key(version: str) -> str:
    """transformers renamed ``torch_dtype`` to ``dtype`` in 4.56."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
