"""What every process of one run builds identically from the run's config.

The model's initial parameters Theta_0 (same seed, same model), the fragment plan, the
method's settings, the embedding names RDA averages plainly, the learners' shards and the
evaluation batches. The syncer and each learner build these on their own from the same
config file, so nothing but algorithm state crosses the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import nn

from ddiloco.config import RunConfig
from ddiloco.core.ledger import TokenLedger
from ddiloco.core.plans import FragmentPlan, scatter
from ddiloco.data.corpus import TokenSplits, eval_batches, split_corpus
from ddiloco.errors import ConfigError
from ddiloco.models.gpt import embedding_names
from ddiloco.models.registry import build_model
from ddiloco.strategies import FRAGMENT_STRATEGIES, SimSettings
from ddiloco.trainer import evaluate, sequence_length

PROCESS_METHODS = ("decoupled",)  # learners never wait: lock-step methods need a barrier


@dataclass
class RunSetup:
    config: RunConfig
    method: str = "decoupled"
    model: nn.Module = field(init=False)
    settings: SimSettings = field(init=False)
    plan: FragmentPlan = field(init=False)

    def __post_init__(self) -> None:
        if self.method not in PROCESS_METHODS:
            raise ConfigError("methods", self.method,
                              f"the processes runtime runs {PROCESS_METHODS} (lock-step "
                              "baselines run on the simulated clock)")  # fmt: skip
        self.settings = FRAGMENT_STRATEGIES[self.method](self.config)
        torch.manual_seed(self.config.seed)
        self.model = build_model(self.config.model)
        sync = self.settings.sync
        self.plan = sync.fragment_plan(self.model)

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
        return sequence_length(self.model)

    @cached_property
    def splits(self) -> TokenSplits:
        return split_corpus(self.config.data.source, self.slots, self.config.data.eval_fraction)

    @cached_property
    def eval_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return eval_batches(self.splits.eval, self.seq_len, 16, self.config.data.eval_batches)

    @property
    def steps_each(self) -> int:
        t = self.config.train
        return t.tokens // (t.learners * t.batch_size * self.seq_len)


def eval_loss(setup: RunSetup, fragments: list[list[torch.Tensor]]) -> float:
    """Eval loss of the global parameters (DESIGN decision 6), in the setup's own model."""
    params = dict(setup.model.named_parameters())
    for p, values in enumerate(fragments):
        scatter(setup.plan, p, params, values)
    return evaluate(setup.model, setup.eval_batches)


class TolerantLedger(TokenLedger):
    """The core's ledger, fed over a lossy network: a restarted syncer starts a fresh ledger
    and a learner given up for dead may come back, so a record can contradict what the
    ledger knows. Such a call is counted in ``errors`` (the summary then reports the ledger
    as unbalanced) instead of stopping the syncer."""

    def __init__(self, num_fragments: int) -> None:
        super().__init__(num_fragments)
        self.errors = 0

    def _guard(self, fn: object, *args: object) -> None:
        try:
            fn(*args)  # type: ignore[operator]
        except ConfigError:
            self.errors += 1

    def trained(self, learner: int, tokens: int) -> None:
        self._guard(super().trained, learner, tokens)

    def answered(self, learner: int, fragment: int, key: object, c_tokens: int) -> int:
        self._guard(super().answered, learner, fragment, key, c_tokens)
        return 0

    def rebased(self, learner: int, fragment: int) -> None:
        self._guard(super().rebased, learner, fragment)

    def crashed(self, learner: int, reason: str = "crash") -> None:
        self._guard(super().crashed, learner, reason)

    def merged_answer(self, key: object, weight: float) -> None:
        self._guard(super().merged_answer, key, weight)

    def wasted_answer(self, key: object, reason: str) -> None:
        self._guard(super().wasted_answer, key, reason)

    def superseded(self, old: object, new: object) -> None:
        self._guard(super().superseded, old, new)
