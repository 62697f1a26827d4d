"""The model contract checked before training on the simulated clock (the processes runtime's
pre-flight runs the same check: tests/integration/test_processes_failures.py), and what a
``module:function`` model and the built-in GPT get from the run config."""

from __future__ import annotations

import time

import pytest
import torch
from prepared import write_meta

from ddiloco.cli import main
from ddiloco.config import RunConfig, load_config
from ddiloco.errors import ConfigError
from ddiloco.models.gpt import GPT_CONFIGS
from ddiloco.models.registry import build_model
from ddiloco.runtime import contract
from ddiloco.runtime.contract import assemble, check_contract

MODELS = '''
import torch
from torch import nn
from ddiloco.data.info import vocab_size
from ddiloco.models.gpt import GPT, GPTConfig

SMALL = GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=32)

def sized(config):
    """Takes the run config: shaped for its data and sequence length."""
    block = config.train.seq_len or 32
    return GPT(GPTConfig(vocab_size=vocab_size(config.data.source), n_layer=1, n_head=1,
                         n_embd=16, block_size=block))

def two_args(config, other):
    return GPT(SMALL)

class LogitsOnly(GPT):
    def forward(self, idx, targets=None):
        return super().forward(idx, targets)[0]

class NanLoss(GPT):
    def forward(self, idx, targets=None):
        logits, loss = super().forward(idx, targets)
        return logits, loss * float("nan")

class Detached(GPT):
    def forward(self, idx, targets=None):
        logits, loss = super().forward(idx, targets)
        return logits, loss.detach().requires_grad_()

class NoContext(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 8)
        self.head = nn.Linear(8, 256)

    def forward(self, idx, targets=None):
        if idx.shape[1] > 64:
            raise RuntimeError("sequence too long")
        logits = self.head(self.emb(idx))
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

def logits_only():
    return LogitsOnly(SMALL)

def nan_loss():
    return NanLoss(SMALL)

def detached():
    return Detached(SMALL)

def no_context():
    return NoContext()

def small():
    return GPT(SMALL)
'''

RUN = ["methods=['decoupled']", "chaos=[]", "train.learners=2", "data.eval_batches=1"]


@pytest.fixture
def models(tmp_path, monkeypatch) -> str:
    (tmp_path / "contractmodels.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "contractmodels"


def config_of(*sets: str) -> RunConfig:
    return load_config(None, [*RUN, *sets])


def test_the_check_takes_about_a_second_for_the_default_model():
    torch.set_num_threads(2)
    started = time.monotonic()
    check_contract(assemble(config_of()))
    assert time.monotonic() - started < 10.0  # ~1 s on 2 idle cores, most of it the corpus split


@pytest.mark.parametrize(
    ("factory", "sets", "match"),
    [
        ("logits_only", [], r"forward returned a tensor of shape \(2, 32, 256\), not \(logits"),
        ("nan_loss", [], r"loss is nan at initialization"),
        ("detached", [], r"the loss has no gradient for any parameter"),
        ("small", ["train.seq_len=64"], r"train.seq_len=64: longer than the context of model "
         r"'contractmodels:small' \(32 tokens: config.block_size\)"),
        ("no_context", [], r"raised RuntimeError: sequence too long \(the model's config "
         r"declares no context .*sequences are 128 tokens; set train.seq_len\)"),
        ("two_args", [], r"the factory requires \(config, other\)"),
    ],
)  # fmt: skip
def test_a_model_that_breaks_the_contract_is_refused_in_one_line(
    models, tmp_path, capsys, factory, sets, match
):
    out = tmp_path / "run"
    argv = ["train", "--quiet", "--out", str(out), "--set", f"model='{models}:{factory}'"]
    for item in (*RUN, *sets):
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("ddiloco train: error: ")
    assert __import__("re").search(match, err), err
    assert not (out / "config.toml").exists()  # refused before the run started


def test_a_model_without_a_declared_context_trains_with_train_seq_len(models):
    check_contract(assemble(config_of(f"model='{models}:no_context'", "train.seq_len=64")))


def test_cuda_on_a_cpu_build_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match=r"train.device='cuda': CUDA is not available \(torch "):
        check_contract(assemble(config_of("train.device='cuda'")))


def test_bf16_is_refused_where_the_device_cannot_autocast(monkeypatch):
    assert contract.bf16_works(torch.device("cpu"))  # this torch autocasts to bf16 on CPU
    config = config_of("model='gpt-tiny'", "train.precision='bf16'")
    check_contract(assemble(config))
    monkeypatch.setattr(contract, "bf16_works", lambda device: False)  # a device that cannot
    with pytest.raises(ConfigError, match=r"train.precision='bf16': cpu cannot autocast to bf16"):
        check_contract(assemble(config))
    check_contract(assemble(config_of("model='gpt-tiny'", "train.precision='fp32'")))


def test_a_vocabulary_smaller_than_the_data_is_refused(models, tmp_path):
    data = tmp_path / "tokens"
    write_meta(data, 300)
    config = config_of(f"model='{models}:small'", f"data.source='{data}'")
    with pytest.raises(ConfigError, match=r"vocabulary 256 < 300: tokens are ids of data.source"):
        check_contract(assemble(config))


def test_a_factory_of_one_parameter_gets_the_run_config(models, tmp_path):
    data = tmp_path / "tokens"
    write_meta(data, 300)
    model = build_model(f"{models}:sized", config_of(f"data.source='{data}'", "train.seq_len=48"))
    assert (model.config.vocab_size, model.config.block_size) == (300, 48)
    default = build_model(f"{models}:sized")  # no config given: the defaults'
    assert (default.config.vocab_size, default.config.block_size) == (256, 32)
    assert build_model(f"{models}:small").config.block_size == 32  # no parameter: called bare


def test_the_builtin_gpt_takes_the_datas_vocabulary_and_train_seq_len(tmp_path):
    assert build_model("gpt-tiny", config_of()).config is GPT_CONFIGS["gpt-tiny"]  # unchanged
    assert build_model("gpt-tiny", config_of("train.seq_len=64")).config is GPT_CONFIGS["gpt-tiny"]
    longer = build_model("gpt-tiny", config_of("train.seq_len=96")).config
    assert (longer.block_size, longer.n_embd) == (96, GPT_CONFIGS["gpt-tiny"].n_embd)
    data = tmp_path / "tokens"
    write_meta(data, 1024)
    assert build_model("gpt-tiny", config_of(f"data.source='{data}'")).config.vocab_size == 1024
