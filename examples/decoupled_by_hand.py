"""Decoupled DiLoCo by hand: two learners, one syncer, and a clock you advance yourself.

No event queue, no wire, no threads: the same core objects the runtimes drive
(``LearnerSync``, ``SyncerState``, ``TokenLedger``; docs/design.md §6.1), called in order
from one loop. Each tick is one second. Learner 0 takes a step every tick, learner 1 every
other tick (it is twice as slow). After each step a learner reports its progress; the
syncer's clock is the fastest learner's step (K = 1), and when it reaches a fragment's offset
the syncer opens a round and asks both learners. A learner answers at its next step boundary
(its delta against the base it last received), then applies whatever merged fragments have
reached it. The syncer looks at its answers and deadlines once per tick: a round closes when
both learners answered, or when the grace window after the quorum ran out (§3.5). With
``grace=False`` a round closes at its quorum: the slow learner misses every round that opens
while it is mid-step, and its answer rides one version late in the next round of that
fragment (§3.4, §3.6). Same seed, same output.

    python examples/decoupled_by_hand.py [steps]   # both runs, ~10 s on 2 CPU cores
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from ddiloco.config import TrainConfig
from ddiloco.core.fragments import scatter
from ddiloco.core.grace import GraceConfig
from ddiloco.core.learner_state import LearnerSync
from ddiloco.core.ledger import TokenLedger
from ddiloco.core.plans import build_plan, tensor_specs
from ddiloco.core.rounds import RoundConfig
from ddiloco.core.syncer_state import SyncerConfig, SyncerState
from ddiloco.data.corpus import BatchStream, eval_batches, split_corpus
from ddiloco.models.gpt import embedding_names
from ddiloco.models.registry import build_model
from ddiloco.trainer import Trainer, evaluate, sequence_length

MODEL = "gpt-tiny"  # 2 layers, ~0.1M parameters, 64-token context
FRAGMENTS, SYNC_EVERY, OVERLAP, QUORUM = 8, 8, 2, 1  # P, H (one fragment per step), tau, K
EVERY = (1, 2)  # learner m steps on ticks divisible by EVERY[m]: learner 1 is twice as slow
TICK = 1.0  # seconds of the hand-advanced clock per tick


@dataclass
class Learner:
    id: int
    every: int
    trainer: Trainer
    sync: LearnerSync
    asks: dict[int, int] = field(default_factory=dict)  # fragment -> round id, not yet answered
    inbox: dict[int, tuple[int, list[torch.Tensor]]] = field(default_factory=dict)  # merged


def main(steps: int = 120, grace: bool = True, verbose: bool = True) -> dict[str, object]:
    say = print if verbose else (lambda *a: None)
    torch.manual_seed(0)
    data = split_corpus("shakespeare", num_shards=len(EVERY))  # disjoint shards + an eval split
    reference = build_model(MODEL)  # Theta_0: every replica and the syncer start from it
    seq = sequence_length(reference)
    batches = eval_batches(data.eval, seq, batch_size=16, max_batches=8)
    plan = build_plan(tensor_specs(reference), FRAGMENTS, sync_every=SYNC_EVERY, split_rows=True)

    ledger = TokenLedger(plan.num_fragments)
    rounds = RoundConfig(quorum=QUORUM, overlap=OVERLAP, grace=GraceConfig(enabled=grace))
    syncer = SyncerState(
        plan,
        dict(reference.named_parameters()),
        SyncerConfig(rounds=rounds),
        plain_tensors=embedding_names(reference),
        ledger=ledger,
    )

    learners = []
    for m, every in enumerate(EVERY):
        model = build_model(MODEL)
        model.load_state_dict(reference.state_dict())
        stream = BatchStream(data.shards[m], batch_size=8, seq_len=seq, seed=m)
        config = TrainConfig(batch_size=8, lr=3e-3, warmup_steps=10)
        trainer = Trainer(model, stream, config, total_steps=steps // every)
        learners.append(Learner(m, every, trainer, LearnerSync(m, plan, trainer.params())))
        syncer.join(m)  # the learner is live: it is asked in every round from now on

    def global_loss() -> float:  # evaluation always uses the syncer's Theta (§4.2)
        params = dict(reference.named_parameters())
        for p in range(plan.num_fragments):
            scatter(plan, p, params, syncer.fragments[p])
        return float(evaluate(reference, batches))

    def boundary(learner: Learner, now: float) -> None:
        """Between two steps: answer what was asked, then apply merged fragments (§3.3)."""
        params = learner.trainer.params()
        for p, round_id in sorted(learner.asks.items()):
            snap = learner.sync.answer(p, round_id, params)  # delta = theta_p - Theta_p^base
            ledger.answered(learner.id, p, snap.meta.key, snap.meta.c_tokens)
            verdict = syncer.on_answer(snap.meta, snap.delta, now)  # arrives at once here
            if verdict.value not in ("accepted", "waiting"):
                say(f"  t={now:5.1f} learner {learner.id} fragment {p}: {verdict.value}")
        learner.asks.clear()
        for p, (version, values) in sorted(learner.inbox.items()):
            if learner.sync.apply(p, version, values, params):  # overwrite, rebase, reset
                ledger.rebased(learner.id, p)  # unpushed progress on p is overwritten
        learner.inbox.clear()

    before = global_loss()
    say(f"eval loss of the global model at the start: {before:.4f}")
    for tick in range(1, steps + 1):
        now = tick * TICK
        for learner in learners:
            if tick % learner.every:
                continue  # still computing its step
            _, tokens = learner.trainer.train_step()
            learner.sync.stepped(tokens)  # c_steps[p] += 1, c_tokens[p] += tokens, every p
            ledger.trained(learner.id, tokens)
            opened = syncer.on_progress(
                learner.id, learner.sync.step, now, step_seconds=learner.every * TICK
            )
            for rnd in opened:  # the global step reached t_p: ask every live learner
                for m in rnd.asked:
                    learners[m].asks[rnd.fragment] = rnd.round_id
            boundary(learner, now)
        for result in syncer.poll(now):  # rounds whose quorum is met and grace is over
            result.book(ledger)  # the merged answers' tokens, counted
            values = [t.clone() for t in result.tensors]  # the syncer updates its own in place
            for learner in learners:
                learner.inbox[result.fragment] = (result.version, values)
            syncer.record_sync_time(TICK)  # a merged fragment reaches learners a tick later
            rnd = result.round
            if result.version == 2:  # the second pass over the fragments: late answers show
                fresh = sorted(a.learner for a in rnd.answers if a.base_version == rnd.version)
                late = sorted(a.learner for a in rnd.answers if a.base_version < rnd.version)
                weights = ", ".join(f"L{m}: {w:.3g}" for m, w in sorted(result.weights.items()))
                say(
                    f"  t={now:5.1f} fragment {result.fragment} -> v{result.version}: "
                    f"fresh {fresh} late {late}, grace {rnd.grace:.2f} s, weights {weights}"
                )

    ledger.close()  # what is still in a learner or in flight is wasted, with its reason
    after = global_loss()
    summary = ledger.summary()
    efficiency = sum(ledger.merged) / plan.num_fragments / max(ledger.trained_tokens, 1)
    say(f"eval loss of the global model at the end:   {after:.4f}")
    say(
        f"rounds merged: {syncer.counts.get('merged_rounds', 0)}, answers: "
        f"{ {k: v for k, v in sorted(syncer.counts.items()) if k != 'merged_rounds'} }"
    )
    say(
        f"tokens trained {summary['tokens']}, merged {summary['tokens_merged']:.0f} "
        f"(token efficiency {efficiency:.1%}), wasted {summary['tokens_wasted']}, "
        f"ledger balanced: {summary['balanced']}"
    )
    return {
        "eval_before": before,
        "eval_after": after,
        "token_efficiency": efficiency,
        "balanced": summary["balanced"],
        "counts": dict(syncer.counts),
        "summary": summary,
    }


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 120
    print("== K = 1 with the adaptive grace window ==")
    main(n)
    print("\n== K = 1, no grace: the slow learner's answers arrive a round late ==")
    main(n, grace=False)
