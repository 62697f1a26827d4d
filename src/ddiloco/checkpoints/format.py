"""What a checkpoint directory holds, where a run keeps them, and how a file is checked.

A checkpoint is a directory a user takes home: the global model's weights
(``model.safetensors``) and its ``config.json`` (for a Hugging Face model, the very files
``save_pretrained`` writes, so ``AutoModelForCausalLM.from_pretrained(dir)`` loads it as it
is; for ddiloco's GPT, the model's name and its ``GPTConfig`` fields), the tokenizer's files,
the run's config (``run.toml``) and ``ddiloco.json``: method, step, tokens, eval loss, the
model spec and, for every other file, its size and BLAKE3 digest. The simulated clock adds
its resume state (``resume/``, :mod:`.sim_state`). Nothing is pickled.

The digests prove a file is the one its manifest lists, not who wrote the manifest. A writer
that holds a run secret (the processes' syncer) adds ``mac``: BLAKE3 keyed by a key derived
from the secret, over the rest of the manifest. A reader with that secret at hand (a run
directory's ``run.secret``) requires it, so a checkpoint altered with fixed-up digests, or
copied in from another run, is refused; elsewhere the digests alone check it.

A run keeps its first method's checkpoints (``config.methods[0]``: the one users take home)
in ``RUN/checkpoints/step-N/`` and every other method's in ``RUN/checkpoints/<method>/step-N/``.
N is the equivalent learner step, ``tokens // (train.learners x tokens per learner step)``, so
checkpoints of different methods at one N have seen the same tokens.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import blake3

from ddiloco.config import RunConfig
from ddiloco.errors import DDiLoCoError

FORMAT = 1  # ddiloco.json's "format": what this build writes and reads
HOME = "checkpoints"  # under the run directory
WEIGHTS = "model.safetensors"
MODEL_CONFIG = "config.json"
RUN_CONFIG = "run.toml"
MANIFEST = "ddiloco.json"
STEP = re.compile(r"step-(\d+)")
KINDS = ("gpt", "hf", "module")  # ddiloco's GPT, a Hugging Face model, a module:function
MAC = "mac"  # the manifest's keyed digest, when its writer held a run secret
MAC_CONTEXT = "ddiloco 2026-12-05 checkpoint manifest mac"  # (BLAKE3 key derivation)


class CheckpointError(DDiLoCoError):
    """A checkpoint that cannot be used (missing, truncated, damaged, another build's) or
    cannot be written; the message names the file."""

    def __init__(self, path: Path | str, why: str) -> None:
        super().__init__("checkpoint", str(path), why)
        self.path = Path(path)
        self.args = (f"checkpoint {path}: {why}",)  # the whole path, not a shortened repr


def step_name(step: int) -> str:
    return f"step-{step}"


def home_of(run: Path, config: RunConfig, method: str) -> Path:
    """Where a run keeps ``method``'s checkpoints (the first method's at the top)."""
    home = run / HOME
    return home if not config.methods or method == config.methods[0] else home / method


def equivalent_step(tokens: int, learners: int, tokens_per_step: int) -> int:
    """The learner step a run's ``tokens`` amount to (every learner stepping alike)."""
    return tokens // max(1, learners * tokens_per_step)


def steps_in(home: Path) -> list[int]:
    """The steps of the complete checkpoints in ``home`` (a temp directory never matches)."""
    if not home.is_dir():
        return []
    found = [
        int(m[1])
        for p in home.iterdir()
        if p.is_dir() and (m := STEP.fullmatch(p.name)) and (p / MANIFEST).is_file()
    ]
    return sorted(found)


def digest(path: Path) -> str:
    """BLAKE3 of a file, hex (hashed on every core; the GIL is released while it runs)."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if path.stat().st_size:
        hasher.update_mmap(path)
    return str(hasher.hexdigest())


def manifest_key(secret: bytes) -> bytes:
    """The key a run's checkpoint manifests are authenticated under, derived from its
    secret (never the secret itself: a manifest's MAC tells nothing of it)."""
    return blake3.blake3(secret, derive_key_context=MAC_CONTEXT).digest()


def manifest_mac(manifest: Mapping[str, Any], key: bytes) -> str:
    """The keyed BLAKE3 of a manifest without its ``mac`` (canonical JSON)."""
    body = {k: v for k, v in manifest.items() if k != MAC}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return str(blake3.blake3(text.encode(), key=key).hexdigest())


def mac_holds(manifest: Mapping[str, Any], key: bytes) -> bool:
    mac = manifest.get(MAC)
    return isinstance(mac, str) and hmac.compare_digest(mac, manifest_mac(manifest, key))
