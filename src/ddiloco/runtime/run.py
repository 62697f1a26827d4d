"""What every runtime (and every process of one run) builds identically from the config.

The method (:mod:`ddiloco.methods`), the model's initial parameters Theta_0 (same seed, same
model: the reference model), the fragment plan, the embedding names RDA averages plainly,
the learners' shards, the evaluation batches and the step budget. The simulated clock builds
it once per method; under real processes the syncer and each learner build it on their own
from the same config file, so nothing but algorithm state crosses the wire. Also the one
evaluation of the global fragments every runtime reports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import nn

from ddiloco.config import RunConfig
from ddiloco.core.fragments import scatter
from ddiloco.core.plans import FragmentPlan
from ddiloco.data.corpus import TokenSplits, eval_batches, split_corpus
from ddiloco.errors import ConfigError
from ddiloco.imports import find_callable
from ddiloco.methods import Method, method_for
from ddiloco.models.embeddings import embedding_names
from ddiloco.models.registry import build_model
from ddiloco.trainer import evaluate, learning_rate, sequence_length

EVAL_BATCH_SIZE = 16  # sequences per evaluation batch (the eval set is data.eval_batches of them)

Batches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class RunSetup:
    """One method's run, assembled. ``splits`` / ``evals`` may be handed in (the simulated
    clock splits the corpus once for every method); otherwise they are built on first use."""

    config: RunConfig
    method_name: str = "decoupled"
    splits_given: TokenSplits | None = None
    evals_given: Batches | None = None
    method: Method = field(init=False)
    model: nn.Module = field(init=False)  # the reference model: Theta_0, then the evaluator's
    plan: FragmentPlan = field(init=False)

    def __post_init__(self) -> None:
        self.method = method_for(self.config, self.method_name)
        torch.manual_seed(self.config.seed)
        self.model = build_model(self.config.model, self.config)
        self.plan = self.method.sync.fragment_plan(self.model)

    @property
    def initial(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    @property
    def plain(self) -> set[str]:
        return embedding_names(self.model)

    @property
    def slots(self) -> int:
        return self.config.train.learners + self.config.train.scavenged

    @property
    def seq_len(self) -> int:
        return sequence_length(self.model, self.config.train.seq_len)

    @property
    def tokens_per_step(self) -> int:
        """Tokens one learner's step trains (``grad_accum`` batches of ``batch_size``)."""
        t = self.config.train
        return t.batch_size * t.grad_accum * self.seq_len

    @property
    def steps_each(self) -> int:
        """Inner steps each learner plans for (its LR schedule's length)."""
        t = self.config.train
        return t.tokens // (t.learners * self.tokens_per_step)

    def lr_factor(self, step: int) -> float:
        """The inner learning rate at ``step`` over its peak: what the outer momentum
        follows (core/outer.py)."""
        t = self.config.train
        return learning_rate(t, step, max(self.steps_each, 1)) / t.lr

    def outer_schedule(self) -> Callable[[int], float] | None:
        """The schedule the syncer's outer momentum follows; None: plain outer steps."""
        return self.lr_factor if self.method.sync.outer.follows_schedule else None

    @cached_property
    def splits(self) -> TokenSplits:
        if self.splits_given is not None:
            return self.splits_given
        return split_corpus(self.config.data.source, self.slots, self.config.data.eval_fraction)

    @cached_property
    def eval_batches(self) -> Batches:
        if self.evals_given is not None:
            return self.evals_given
        return make_eval_batches(self.config, self.splits, self.seq_len)

    def replica(self) -> nn.Module:
        """A learner's model: the same architecture, starting from Theta_0."""
        model = build_model(self.config.model, self.config)
        model.load_state_dict(self.model.state_dict())
        return model

    def eval_loss(
        self, fragments: Sequence[Sequence[torch.Tensor]], model: nn.Module | None = None
    ) -> float:
        """Eval loss of the global parameters (the syncer's fragments: what a user would take
        home), in the reference model or in ``model`` (a copy: an evaluation on a thread)."""
        model = self.model if model is None else model
        params = dict(model.named_parameters())
        for p, values in enumerate(fragments):
            scatter(self.plan, p, params, values)
        return self.evaluate(model)

    def evaluate(
        self,
        model: nn.Module,
        batches: Batches | None = None,
        hold: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> float:
        """The run's evaluation of ``model`` on ``batches`` (default: the eval set): the
        user's ``train.evaluate`` (``function(model, batches) -> mean loss``) when named,
        else ddiloco's (``model(inputs, targets) -> (logits, loss)``, nats per token), each
        slice's forward inside ``hold()`` (ddiloco's only: a user's evaluation is one
        call)."""
        batches = self.eval_batches if batches is None else batches
        if not self.config.train.evaluate:
            return evaluate(model, batches, hold)
        with torch.no_grad():
            loss = self.user_evaluation(model, batches)
        try:
            return float(loss)
        except (TypeError, ValueError):
            why = f"returned {type(loss).__name__}, not a number (the mean loss)"
            raise ConfigError("train.evaluate", self.config.train.evaluate, why) from None

    @cached_property
    def user_evaluation(self) -> Callable[[nn.Module, Batches], Any]:
        return find_callable(self.config.train.evaluate, "train.evaluate")


def make_eval_batches(config: RunConfig, splits: TokenSplits, seq_len: int) -> Batches:
    return eval_batches(splits.eval, seq_len, EVAL_BATCH_SIZE, config.data.eval_batches)
