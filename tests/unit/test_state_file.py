"""A process's own state files: written atomically, read back checked to the byte, refused
naming the file when damaged or another run's; a learner's local checkpoints."""

from __future__ import annotations

import pytest
import torch

from ddiloco.checkpoints.format import CheckpointError
from ddiloco.config import load_config
from ddiloco.runtime.processes.learner.local_checkpoint import (
    LEARNER_STATE,
    LocalCheckpoints,
    identity,
    load_latest,
)
from ddiloco.runtime.processes.state_file import StateFile
from ddiloco.runtime.run import RunSetup

KIND = StateFile(b"TESTSTA\0", 3, ("step", "weights"), "test state", prefix="s", keep=2)


def state(step: int) -> dict[str, object]:
    return {"step": step, "weights": torch.arange(6.0).reshape(2, 3) * step, "note": "x"}


def test_a_save_reads_back_equal_and_only_the_newest_are_kept(tmp_path):
    for step in (3, 10, 7, 12):
        KIND.write(tmp_path, step, state(step))
    assert [s for s, _ in KIND.saves(tmp_path)] == [10, 12]  # the newest two, by step
    step, path = KIND.latest(tmp_path) or (0, tmp_path)
    back = KIND.read(path)
    assert step == 12 and back["step"] == 12 and back["note"] == "x"
    torch.testing.assert_close(back["weights"], state(12)["weights"])
    assert not list(tmp_path.glob(".*.tmp"))  # no temp file left behind


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda b: b[:10], "truncated: 10 bytes"),
        (lambda b: b[:-5], "truncated or extended"),
        (lambda b: b + b"!", "truncated or extended"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum mismatch"),
        (lambda b: b"OTHERKND" + b[8:], r"not a ddiloco test state \(bad magic\)"),
        (lambda b: b[:8] + (9).to_bytes(4, "little") + b[12:], "format version 9"),
    ],
)
def test_every_damage_is_refused_naming_the_file(tmp_path, damage, why):
    path, _ = KIND.write(tmp_path, 1, state(1))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointError, match=why) as err:
        KIND.read(path)
    assert str(path) in str(err.value)


def test_a_keyed_save_is_bound_to_its_run_secret(tmp_path):
    """A save digested under the run secret's key: read back under it; refused under another
    run's, without a key, and when someone without the secret rewrote it and recomputed a
    plain digest (the tamperer of a `--resume` save, issue 29)."""
    import blake3

    from ddiloco.runtime.processes.state_file import KEYED, state_key

    key, other = state_key(bytes(range(32))), state_key(bytes(range(1, 33)))
    assert key != other and len(key) == 32
    path, _ = KIND.write(tmp_path, 1, state(1), key)
    assert KIND.read(path, key)["step"] == 1
    with pytest.raises(CheckpointError, match="another run's") as err:
        KIND.read(path, other)
    assert str(path) in str(err.value)
    with pytest.raises(CheckpointError, match="this reader has none"):
        KIND.read(path)
    plain, _ = KIND.write(tmp_path / "plain", 1, state(1))
    with pytest.raises(CheckpointError, match="not digested under the run secret"):
        KIND.read(plain, key)
    n, head = len(KIND.magic), KIND.head
    # tampered: another state put in its place, digested the only way a forger can
    forged = bytearray(KIND.write(tmp_path / "f", 2, state(2))[0].read_bytes())
    forged[n : n + 4] = (KIND.version | KEYED).to_bytes(4, "little")  # claims to be keyed
    hasher = blake3.blake3(bytes(forged[: n + 12]))  # ... with the only digest it can make
    hasher.update(bytes(forged[head:]))
    forged[n + 12 : head] = hasher.digest()
    path.write_bytes(bytes(forged))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        KIND.read(path, key)


def test_a_missing_field_or_file_is_refused(tmp_path):
    path, _ = KIND.write(tmp_path, 1, {"step": 1})
    with pytest.raises(CheckpointError, match=r"missing fields \['weights'\]"):
        KIND.read(path)
    with pytest.raises(CheckpointError, match="cannot read it"):
        KIND.read(tmp_path / "s-00000002.bin")


def test_a_learners_local_checkpoint_is_refused_for_another_model_or_plan(tmp_path):
    base = ["model='gpt-tiny'", "train.learners=2", "sync.fragments=4"]
    setup = RunSetup(load_config(None, base))
    saves = LocalCheckpoints(tmp_path, every=3600.0, expected=identity(setup, 1))
    assert not saves.due()
    saves.last -= 3601.0  # an hour later
    assert saves.due()
    saves.save(5, {"trainer": {"steps": 5}, "sync": {}, "learner": 1})
    saves.close()
    assert saves.saved == 1 and not saves.due()
    loaded = load_latest(tmp_path, identity(setup, 1))
    assert loaded is not None and loaded["trainer"] == {"steps": 5}
    other = RunSetup(load_config(None, [*base[:2], "sync.fragments=3"]))
    with pytest.raises(CheckpointError, match=r"another run's state: fragments 4 \(this run: 3\)"):
        load_latest(tmp_path, identity(other, 1))
    with pytest.raises(CheckpointError, match="learner 1"):
        load_latest(tmp_path, identity(setup, 0))
    assert load_latest(tmp_path / "none", identity(setup, 1)) is None
    assert LEARNER_STATE.latest(tmp_path) is not None


def test_a_learner_that_never_checkpoints_writes_nothing(tmp_path):
    saves = LocalCheckpoints(tmp_path / "x", every=0.0, expected={})
    assert not saves.due()
    assert not (tmp_path / "x").exists()


def _forged(path, payload: bytes) -> None:
    """A file of ``KIND`` holding ``payload`` with a correct length and digest (BLAKE3 is not
    a secret: anyone who can write the directory can forge one)."""
    import blake3

    head = KIND.magic + KIND.version.to_bytes(4, "little") + len(payload).to_bytes(8, "little")
    path.write_bytes(head + blake3.blake3(head + payload).digest() + payload)


@pytest.mark.parametrize(
    ("tensors", "sizes", "why"),
    [
        ([["float32", [1 << 40]]], [4 << 40], r"claims \d+ bytes"),  # a 4 TB tensor in a tiny file
        ([["float32", [2, 3]]], [7], "does not make 7 bytes"),  # shape and size disagree
        ([["pickle", [1]]], [1], "unknown tensor dtype"),
    ],
)
def test_a_forged_file_with_a_lying_head_is_refused_before_anything_is_allocated(
    tmp_path, tensors, sizes, why
):
    import msgpack

    head = msgpack.packb(
        {"tree": {"step": 1, "weights": {"__tensor__": 0}}, "tensors": tensors, "sizes": sizes}
    )
    path = tmp_path / "s-1.bin"
    _forged(path, len(head).to_bytes(8, "little") + head + bytes(24))
    with pytest.raises(CheckpointError, match=why) as err:
        KIND.read(path)
    assert str(path) in str(err.value)


def test_a_save_streamed_from_live_tensors_is_the_state_at_the_save(tmp_path):
    live = state(5)
    staged = KIND.stage(tmp_path, 5, live)  # the caller's thread: its tensors are written
    live["weights"].add_(100.0)  # training goes on before the save is published
    path, size = KIND.publish(staged)
    assert path.stat().st_size == size
    torch.testing.assert_close(KIND.read(path)["weights"], state(5)["weights"])


def test_saves_are_private_files_in_a_private_directory_whatever_the_umask(tmp_path):
    import os
    import stat

    loose = tmp_path / "learner-0"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)  # a directory left by an older version, or made by hand
    old = os.umask(0o022)
    try:
        path, _ = KIND.write(loose, 1, {"step": 1, "weights": torch.ones(3)})
        fresh, _ = KIND.write(
            tmp_path / "new" / "learner-1", 1, {"step": 1, "weights": torch.ones(3)}
        )
    finally:
        os.umask(old)
    for file in (path, fresh):
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, oct(file.stat().st_mode)
        assert stat.S_IMODE(file.parent.stat().st_mode) == 0o700, oct(file.parent.stat().st_mode)
