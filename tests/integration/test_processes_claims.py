"""What a learner claims in its hello is checked against what the run knows: a step far
beyond anything credited is capped (it would move the global step past every round), and
fragment versions the syncer's store never made (a store restored from an older backup) are
refused by name, loudly, instead of a run that merges nothing in silence."""

from __future__ import annotations

import shutil
import time

from attackers import RUN, SECRET, Insider, SyncerProcess, start_learner

from ddiloco.errors import FATAL_EXIT


def progress(learner: Insider, step: int) -> None:
    meta = {"inc": learner.wire.session, "step": step, "tokens": 256, "secs": 0.01}
    learner.send("progress", meta={**meta, "rebased": [], "total": 256 * step, "rebases": [0, 0]})


def test_a_hello_claiming_a_billion_steps_is_capped_and_rounds_keep_opening(tmp_path):
    syncer = SyncerProcess(tmp_path, ["train.batch_size=4"])
    honest, liar = Insider(syncer.address, m=0, session=5), Insider(syncer.address, m=1, session=6)
    try:
        honest.register()
        liar.prove()
        liar.send("hello", meta={"inc": 6, "step": 10**9, "versions": [0, 0]})
        welcome = liar.expect("welcome")
        assert welcome.header.meta["global_step"] < 100  # the claim did not move the clock
        for step in range(1, 9):  # the honest learner's steps still open rounds
            progress(honest, step)
        asked = honest.expect("ask", timeout=10.0)
        honest.send("hello", meta={"inc": 5, "step": 8, "versions": [0, 0]})  # where is the
        msg = honest.expect("welcome")  # global step now? (a re-hello's welcome says)
        summary = syncer.stop()
    finally:
        honest.close()
        liar.close()
        syncer.kill()
    assert asked.header.round >= 0
    assert msg.header.meta["global_step"] < 100  # (it was 10^9: no round opened again)
    assert summary["service"]["hello_step_capped"] == 1
    assert "claims step 1000000000" in syncer.stderr and "(hello_step_capped)" in syncer.stderr


def wait_rounds(syncer: SyncerProcess, n: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(e["kind"] == "round" for e in syncer.events) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} merged rounds within {timeout}s:\n{syncer.stderr}")


def test_a_store_restored_from_an_older_backup_is_refused_by_name(tmp_path):
    syncer = SyncerProcess(tmp_path)
    address, store = syncer.address, tmp_path / "store"
    learner = start_learner(syncer.config_path, address, SECRET, RUN)
    try:
        wait_rounds(syncer, 2)
        syncer.kill()  # (no syncer runs while the backup is taken: it is consistent)
        shutil.copytree(store, tmp_path / "backup")
        syncer = SyncerProcess(tmp_path, address=address)  # the same store: the run goes on
        wait_rounds(syncer, 4)
        syncer.kill()
        shutil.rmtree(store)
        shutil.copytree(tmp_path / "backup", store)  # an operator restores the older backup
        syncer = SyncerProcess(tmp_path, address=address)
        code = learner.wait(timeout=90)
        err = learner.communicate()[1]
        summary = syncer.stop()
    finally:
        if learner.poll() is None:
            learner.kill()
        syncer.kill()
    assert code == FATAL_EXIT, err
    assert "the store is older than the run" in err and str(store) in err, err
    assert summary["service"]["refused_ahead"] >= 1
    assert "the store is older than the run" in syncer.stderr


def test_a_syncer_killed_in_its_final_rounds_runs_them_again_after_its_restart(tmp_path):
    """The final rounds are the run's guarantee that every learner's last work is merged. A
    syncer SIGKILLed in them used to restart past the budget knowing nobody and end at once;
    it now waits for its learners to register again and asks them again."""
    overrides = ["train.learners=1", "train.batch_size=4", "train.tokens=1024"]
    overrides += ["processes.final_round_seconds=60"]
    syncer = SyncerProcess(tmp_path, overrides)
    address = syncer.address
    learner = Insider(address, m=0, session=5)
    try:
        learner.register()
        for step in range(1, 9):  # past the budget: the final rounds begin
            progress(learner, step)
        first = learner.expect("ask", timeout=20.0)
        while not first.header.meta.get("final"):
            first = learner.expect("ask", timeout=20.0)
        time.sleep(1.0)  # (the ledger, saved every beat, holds this life)
        syncer.kill()  # in the final rounds: the learner never answered
        learner.close()
        syncer = SyncerProcess(tmp_path, overrides, address=address)
        learner = Insider(address, m=0, session=5)  # the same life, a new connection
        learner.prove()
        learner.send("hello", meta={"inc": 5, "step": 8, "versions": [0, 0]})
        learner.expect("welcome")
        again = learner.expect("ask", timeout=20.0)
        alive = syncer.proc.poll() is None
        summary = syncer.stop()
    finally:
        learner.close()
        syncer.kill()
    assert again.header.meta.get("final"), again.header.meta
    assert alive
    assert "waiting up to 15s for learner 0 to register again" in syncer.stderr
    assert summary["tokens"] >= 1024
