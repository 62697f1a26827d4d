"""The syncer's durable store: every write is all-or-nothing, and a restart restores it all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ddiloco.core.ledger import TokenLedger
from ddiloco.core.plans import build_plan, tensor_specs
from ddiloco.core.rounds import AnswerMeta
from ddiloco.core.syncer_state import SyncerConfig, SyncerState
from ddiloco.models.registry import build_model
from ddiloco.runtime.processes.syncer.store import (
    FragmentRecord,
    StoreError,
    SyncerStore,
    record_of,
    restore,
)


def make_syncer() -> SyncerState:
    torch.manual_seed(0)
    model = build_model("gpt-tiny")
    plan = build_plan(tensor_specs(model), 2, "balanced", sync_every=2)
    return SyncerState(plan, dict(model.named_parameters()), SyncerConfig())


def merge_once(syncer: SyncerState, learner: int = 0, seq: int = 0):
    syncer.join(learner)
    rounds = syncer.on_progress(learner, seq + 1, float(seq))
    p = rounds[0].fragment
    meta = AnswerMeta(learner, 5, seq, p, rounds[0].round_id, syncer.versions[p], seq + 1, 1, 64)
    delta = [torch.randn_like(t) * 0.01 for t in syncer.fragments[p]]
    syncer.on_answer(meta, delta, float(seq))
    (result,) = syncer.poll(float(seq) + 10)
    return result, meta


def test_a_restarted_syncer_restores_fragments_outer_state_versions_and_ids(tmp_path):
    syncer = make_syncer()
    store = SyncerStore(tmp_path)
    result, meta = merge_once(syncer)
    p = result.fragment
    store.save(record_of(syncer, p, tokens=64, applied=[meta.key]))
    fresh = make_syncer()
    step, tokens = restore(fresh, store.load())
    assert (step, tokens) == (syncer.global_step, 64)
    assert fresh.versions == syncer.versions
    for a, b in zip(fresh.fragments[p], syncer.fragments[p], strict=True):
        assert torch.equal(a, b)
    ours, theirs = fresh.outer[p].state_dict(), syncer.outer[p].state_dict()
    assert ours["steps"] == theirs["steps"] == 1
    assert all(torch.equal(a, b) for a, b in zip(ours["buffers"], theirs["buffers"], strict=True))
    # the merged answer, pushed again after the restart, is recognised and not applied twice
    fresh.join(0)
    delta = [torch.zeros_like(t) for t in fresh.fragments[p]]
    assert fresh.on_answer(meta, delta, 100.0).value == "duplicate"
    again = AnswerMeta(0, 5, 99, p, meta.round_id, meta.base_version, 9, 1, 64)
    assert fresh.on_answer(again, delta, 100.0).value == "base_already_merged"


def test_a_torn_write_leaves_the_previous_record(tmp_path):
    syncer = make_syncer()
    store = SyncerStore(tmp_path)
    result, meta = merge_once(syncer)
    store.save(record_of(syncer, result.fragment, tokens=64, applied=[meta.key]))
    good = store.fragment_path(result.fragment).read_bytes()
    # a syncer killed mid-write leaves a partial temp file, never a partial record
    tmp = tmp_path / f".{store.fragment_path(result.fragment).name}.tmp"
    tmp.write_bytes(good[: len(good) // 2])
    records = store.load()
    assert records[result.fragment].version == 1
    assert not tmp.exists()


def test_a_damaged_record_is_refused_not_silently_reset(tmp_path):
    syncer = make_syncer()
    store = SyncerStore(tmp_path)
    result, meta = merge_once(syncer)
    store.save(record_of(syncer, result.fragment, tokens=64, applied=[meta.key]))
    path = store.fragment_path(result.fragment)
    data = bytearray(path.read_bytes())
    data[40] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="checksum"):
        store.load()


def test_the_journal_drops_a_torn_tail_and_merges_never_broadcast(tmp_path):
    store = SyncerStore(tmp_path, journal=True)
    store.append_journal({"fragment": 0, "version": 1, "answers": []}, [b"abc"])
    store.append_journal({"fragment": 0, "version": 2, "answers": []}, [b"de", b"f"])
    with store.journal_path.open("ab") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00DDSJ")  # a record cut short by a kill
    values = [torch.zeros(2)]
    outer = {"steps": 0, "buffers": None}
    store.save(FragmentRecord(1, 1, values, outer, fragment=0, global_step=0, tokens=0))
    store.load()  # fragment 0 is durable at version 1: the version-2 merge never happened
    entries = list(store.journal())
    assert [h["version"] for h, _ in entries] == [1]
    assert entries[0][1] == [b"abc"]


WRITER = textwrap.dedent(
    """
    import sys, torch
    from ddiloco.runtime.processes.syncer.store import FragmentRecord, SyncerStore
    store = SyncerStore(sys.argv[1])
    v = 0
    print("go", flush=True)
    while True:
        v += 1
        values = [torch.full((256, 256), float(v)), torch.full((300,), float(v))]
        outer = {"steps": v, "buffers": [t * 2 for t in values]}
        keys = {"fragment": 0, "global_step": v, "tokens": v}
        store.save(FragmentRecord(v, v, values, outer, [(0, 1, v)], {(0, 1): v}, **keys))
    """
)


def test_a_writer_killed_at_a_random_moment_leaves_a_consistent_record(tmp_path):
    env = {**os.environ, "PYTHONPATH": "src"}
    for attempt in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "go"
        time.sleep(0.2 + 0.13 * attempt)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        rec = SyncerStore(tmp_path).load()[0]
        v = rec.version
        assert v >= 1
        assert all(torch.equal(t, torch.full_like(t, float(v))) for t in rec.values)
        assert all(
            torch.equal(b, 2 * t) for b, t in zip(rec.outer["buffers"], rec.values, strict=True)
        )
        assert rec.applied == [(0, 1, v)] and rec.merged_base == {(0, 1): v}


def test_the_ledger_is_restored_from_the_latest_snapshot_written_with_or_between_merges(tmp_path):
    syncer = make_syncer()
    store = SyncerStore(tmp_path)
    assert store.load() == {} and store.ledger_state is None  # a fresh start
    ledger = TokenLedger(2)
    ledger.trained(0, 64)
    result, meta = merge_once(syncer)
    ledger.answered(0, result.fragment, meta.key, 64)
    ledger.merged_answer(meta.key, 1.0)
    with_merge = ledger.to_state()
    store.save(record_of(syncer, result.fragment, 64, [meta.key], with_merge))
    loaded = SyncerStore(tmp_path)
    records = loaded.load()
    assert loaded.ledger_state == with_merge and records[result.fragment].ledger == with_merge
    ledger.trained(1, 32)  # between merges: ledger.bin holds a fresher snapshot
    loaded.save_ledger(ledger.to_state())
    again = SyncerStore(tmp_path)
    again.load()
    assert again.ledger_state == ledger.to_state() and again.seq == 2
    # a merge written later wins over ledger.bin, whichever file is newer on disk
    ledger.trained(1, 32)
    again.save(record_of(syncer, result.fragment, 128, [meta.key], ledger.to_state()))
    last = SyncerStore(tmp_path)
    last.load()
    assert last.ledger_state == ledger.to_state()
    assert TokenLedger.from_state(last.ledger_state).trained_tokens == 128


def test_a_torn_ledger_checkpoint_leaves_the_snapshot_of_the_last_merge(tmp_path):
    syncer = make_syncer()
    store = SyncerStore(tmp_path)
    result, meta = merge_once(syncer)
    ledger = TokenLedger(2)
    ledger.trained(0, 64)
    store.save(record_of(syncer, result.fragment, 64, [meta.key], ledger.to_state()))
    (tmp_path / ".ledger.bin.tmp").write_bytes(b"DDSF\x00\x01")  # killed mid-checkpoint
    loaded = SyncerStore(tmp_path)
    loaded.load()
    assert loaded.ledger_state == ledger.to_state()
    assert not (tmp_path / ".ledger.bin.tmp").exists()


def test_the_store_keeps_what_the_core_calls_a_fragments_state_and_the_syncer_clock(tmp_path):
    # the processes' store and the simulated clock's checkpoints put a fragment back from the
    # same FragmentState (core/fragment_state.py): all of it survives a file, the outer
    # step's period clock and the step-time EMAs included (a restart used to lose both)
    syncer = make_syncer()
    store = SyncerStore(tmp_path)
    result, meta = merge_once(syncer)
    p = result.fragment
    syncer.record_sync_time(0.125)
    store.save(record_of(syncer, p, tokens=64, applied=[meta.key]))
    fresh = make_syncer()
    restore(fresh, store.load())
    ours, theirs = fresh.fragment_state(p, [meta.key]), syncer.fragment_state(p, [meta.key])
    for name in ("version", "next_round_id", "applied", "merged_base", "norm_window"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.merged_opened == theirs.merged_opened is not None
    assert fresh.clock_state() == syncer.clock_state()
    assert syncer.clock_state()[2] == 0.125
