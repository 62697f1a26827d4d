"""The syncer evaluates off its service loop: a large eval set stalls no merge and no beat,
so no learner is given up and the ledger balances (it did not when evaluation ran inline).
Run in place (decision 126): the merges go in between the evaluation's slices (every other
processes test evaluates in the default copy)."""

from __future__ import annotations

from ddiloco.config import load_config


def test_four_learners_with_a_large_eval_set_keep_the_ledger_balanced(tmp_path, launch):
    cfg = load_config(
        None,
        [
            "model='gpt-1m'",
            "methods=['decoupled']",
            "runtime='processes'",
            "train.learners=4",
            "sync.fragments=24",
            "sync.sync_every=24",
            "data.eval_batches=64",
            "train.tokens=60000",
            "train.eval_every=6000",
            "processes.max_wall_seconds=240.0",
            "processes.eval_in_place=true",
        ],
    )
    done: dict[int, int] = {}

    def hook(_, record):
        if record["kind"] == "learner_done":
            done[record["learner"]] = record["tokens"]

    summary, records = launch(cfg, tmp_path, hook)
    assert summary["ledger_balanced"] and summary["ledger_errors"] == 0
    assert not [r for r in records if r["kind"] == "detected"]  # nobody was given up
    evaluations = summary["evaluations"]
    assert evaluations["evals"] >= 1 and evaluations["eval_failed"] == 0
    in_place = [r for r in records if r["kind"] == "eval" and "merged_during" in r]
    assert len(in_place) == evaluations["evals"]  # (the final one is after the last merge)
    assert all(r["tokens"] <= r["tokens_end"] for r in in_place)
    assert sum(r["merged_during"] for r in in_place) > 0  # merges went on meanwhile
    assert summary["rounds"] > 0
    # what the learners trained is what the syncer counted, up to what a learner trains after
    # the syncer's budget is reached: its report in flight, the step it is in when the stop
    # arrives, and one more if the stop crosses a step boundary (3 steps of 8 x 64 tokens)
    assert len(done) == 4
    trained = sum(done.values())
    assert summary["tokens"] <= trained <= summary["tokens"] + 4 * 3 * 8 * 64
