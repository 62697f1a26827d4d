"""The syncer's in-place evaluation: merges and evaluation slices kept apart by a gate in
which a waiting merge goes before the next slice (decision 126), without a network."""

from __future__ import annotations

import threading
import time

from ddiloco.config import load_config
from ddiloco.core.fragments import gather
from ddiloco.runtime.contract import assemble
from ddiloco.runtime.processes.syncer.evaluator import Evaluator, MergeGate


def wait_until(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_waiting_merge_goes_before_the_next_slice() -> None:
    gate, order = MergeGate(), []
    in_slice, end_slice = threading.Event(), threading.Event()

    def first_slice() -> None:
        with gate.reading():
            in_slice.set()
            end_slice.wait()
            order.append("slice 1")

    def merge() -> None:
        with gate.writing():
            order.append("merge")

    def next_slice() -> None:
        with gate.reading():
            order.append("slice 2")

    threads = [threading.Thread(target=first_slice)]
    threads[0].start()
    in_slice.wait()
    threads.append(threading.Thread(target=merge))
    threads[1].start()
    wait_until(lambda: gate._waiting == 1)  # the merge waits for the running slice
    threads.append(threading.Thread(target=next_slice))
    threads[2].start()
    time.sleep(0.1)
    assert order == []  # neither the merge nor the next slice got in during slice 1
    end_slice.set()
    for t in threads:
        t.join(5)
    assert order == ["slice 1", "merge", "slice 2"]
    assert gate.writes == 1 and gate.longest_wait > 0


def test_slices_read_together_and_never_beside_a_merge() -> None:
    gate, inside, seen = MergeGate(), {"readers": 0, "writing": False}, []
    lock = threading.Lock()

    def read(n: int) -> None:
        for _ in range(n):
            with gate.reading():
                with lock:
                    inside["readers"] += 1
                    seen.append(("read", inside["writing"]))
                time.sleep(0.001)
                with lock:
                    inside["readers"] -= 1

    def write(n: int) -> None:
        for _ in range(n):
            with gate.writing():
                with lock:
                    inside["writing"] = True
                    seen.append(("write", inside["readers"]))
                time.sleep(0.001)
                with lock:
                    inside["writing"] = False

    threads = [threading.Thread(target=read, args=(50,)) for _ in range(2)]
    threads.append(threading.Thread(target=write, args=(50,)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [s for s in seen if s[0] == "read" and s[1]] == []  # no slice during a merge
    assert [s for s in seen if s[0] == "write" and s[1]] == []  # no merge during a slice
    assert gate.writes == 50


def setup_of(*overrides: str):
    config = load_config(None, ["model='gpt-tiny'", "data.eval_batches=4", *overrides])
    return assemble(config)


def test_in_place_reads_the_reference_model_and_merges_go_on_between_slices() -> None:
    """In place: the same loss as a copy when nothing merges; while merges keep coming, the
    evaluation still ends, every merge got in between two slices, and the record counts
    them."""
    setup = setup_of()
    events: list[dict] = []

    def record(kind: str, **fields) -> None:
        events.append({"kind": kind, **fields})

    copy = Evaluator(setup, record, in_place=False)
    values = [gather(setup.plan, p, setup.initial) for p in range(setup.plan.num_fragments)]
    assert copy.submit(values, 0)
    copy.wait(60)
    live = Evaluator(setup, record, in_place=True, tokens_now=lambda: 7)
    assert live.in_place
    assert live.submit([], 0)  # (in place: the reference model's own parameters)
    live.wait(60)
    assert events[0]["loss"] == events[1]["loss"]  # bit for bit: one model, read in place
    assert events[1]["merged_during"] == 0 and events[1]["tokens_end"] == 7
    assert "merged_during" not in events[0]  # a copy: one model, always

    stop, merges = threading.Event(), [0]
    param = next(setup.model.parameters())

    def merging() -> None:
        while not stop.is_set():
            with live.gate.writing():
                param.data.mul_(1.0)  # a write to the global values
                merges[0] += 1
            time.sleep(0.001)

    writer = threading.Thread(target=merging)
    writer.start()
    try:
        assert live.submit([], 1)
        live.wait(120)
    finally:
        stop.set()
        writer.join(5)
    assert live.counts == {"evals": 2, "eval_skipped": 0, "eval_failed": 0}
    assert 0 < events[2]["merged_during"] <= merges[0]  # merges were never held off
    assert live.summary()["merge_longest_wait_s"] >= 0.0


def test_a_user_evaluation_is_given_a_copy() -> None:
    setup = setup_of("train.evaluate='ddiloco.trainer:evaluate'")
    assert not Evaluator(setup, lambda *a, **k: None, in_place=True).in_place
