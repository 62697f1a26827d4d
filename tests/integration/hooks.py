"""Launcher hooks the kill-and-recover tests share: kill a learner once the run is under way,
note its recovery, stop the run once it has trained a while after it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def stop_after_recovery(
    launcher: Any,
    r: dict[str, Any],
    state: dict[str, Any],
    steps: int,
    learner: int = 0,
    merged_again: bool = False,
) -> bool:
    """A hook's end: once ``learner``, killed (``state["killed"]``), has recovered, stop the
    run after it trained ``steps`` steps more; True on the ``recovered`` record itself. With
    ``merged_again``, also after a round merged one of its answers since (on a loaded
    machine its first answers can all come late), or 4 x ``steps`` steps at most."""
    if r["kind"] == "recovered" and r["learner"] == learner and "killed" in state:
        state["recovered"] = r
        return True
    if "recovered" not in state:
        return False
    if r["kind"] == "round" and r["weights"].get(str(learner)):
        state["merged_again"] = True
    if r["kind"] == "step" and r["learner"] == learner:
        state["after"] = state.get("after", 0) + 1
        waited = not merged_again or state.get("merged_again") or state["after"] >= 4 * steps
        if state["after"] >= steps and waited and not state.get("stopped"):
            state["stopped"] = True
            launcher.request_stop()
    return False


def kill_then_stop(
    learner: int,
    down: float,
    steps: int = 40,
    rounds: int = 3,
    ready: Callable[[Any], bool] = lambda launcher: True,
    merged_again: bool = False,
) -> tuple[Callable[[Any, dict[str, Any]], None], dict[str, Any]]:
    """A hook that SIGKILLs ``learner`` at one of its steps once ``rounds`` rounds merged (it
    has pushed answers; some may be on the wire) and ``ready(launcher)``, restarting it after
    ``down`` s, then stops the run ``steps`` steps after its recovery (``merged_again``:
    :func:`stop_after_recovery`); and the state it fills (``killed``: the kill's time,
    ``recovered``: the record)."""
    state: dict[str, Any] = {"rounds": 0}

    def hook(launcher: Any, r: dict[str, Any]) -> None:
        state["rounds"] += r["kind"] == "round"
        due = state["rounds"] >= rounds and "killed" not in state and ready(launcher)
        if due and r["kind"] == "step" and r["learner"] == learner:
            state["killed"] = launcher.play_crash(learner, down_seconds=down)
        stop_after_recovery(launcher, r, state, steps, learner, merged_again)

    return hook, state


def kill_syncer_then_stop(
    rounds: int = 6, after: int = 8
) -> tuple[Callable[[Any, dict[str, Any]], None], dict[str, Any]]:
    """A hook that SIGKILLs the syncer once ``rounds`` rounds merged (restarting it 1 s later),
    then stops the run ``after`` rounds after its restore; and the state it fills
    (``versions``: fragment -> the last version broadcast before the kill, ``pid``: the
    killed syncer's, ``restored``: the record, ``after``: rounds since)."""
    state: dict[str, Any] = {"rounds": 0, "versions": {}}

    def hook(launcher: Any, r: dict[str, Any]) -> None:
        if r["kind"] == "round" and "restored" not in state:
            state["rounds"] += 1
            state["versions"][r["fragment"]] = r["version"]  # broadcast: acknowledged
            if state["rounds"] == rounds:
                state["pid"] = launcher.procs["syncer"].pid
                launcher.crash_syncer(down_seconds=1.0)
        if r["kind"] == "restored":
            state["restored"] = r
            state["after"] = 0
        if r["kind"] == "round" and "restored" in state:
            state["after"] += 1
            if state["after"] == after:
                launcher.request_stop()

    return hook, state


def train_with_hook(config: Any, out: Any, hook: Any, monkeypatch: Any) -> Any:
    """``ddiloco train``'s own path (run directory, summary), with ``hook`` on its launcher."""
    import ddiloco.launch as command

    real = command.process_job

    def job(*args: Any, **kwargs: Any) -> Any:
        launcher = real(*args, **kwargs)
        launcher.hooks.append(hook)
        return launcher

    monkeypatch.setattr(command, "process_job", job)
    return command.train(config, out, quiet=True)
