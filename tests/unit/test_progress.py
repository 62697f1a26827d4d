"""The live progress lines: a status line at the configured interval, events as they come."""

from __future__ import annotations

import io

from ddiloco.report.progress import Progress, human_count, human_seconds


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _progress(every: float = 5.0) -> tuple[Progress, io.StringIO, Clock]:
    out, clock = io.StringIO(), Clock()
    return Progress(10_000, stream=out, every=every, clock=clock), out, clock


def _step(m: int, step: int, loss: float, t: float) -> dict[str, object]:
    return {"kind": "step", "learner": m, "step": step, "loss": loss, "batch_tokens": 100, "t": t}


def test_a_status_line_comes_every_interval_with_rate_eta_loss_and_states():
    progress, out, clock = _progress(every=5.0)
    for i in range(21):  # a step of 100 tokens every 0.5 s, the 2 learners in turn
        clock.now = i * 0.5
        progress("decoupled", _step(i % 2, i // 2, 4.0, clock.now))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines  # at 5 s and at 10 s
    last = lines[-1]
    assert "tokens       2,100 ( 21.0%)" in last and "200 tok/s" in last, last
    assert "ETA 37s" in last and "loss 4.000" in last and "0:s10 1:s9" in last, last


def test_events_print_as_they_happen_and_change_the_learners_states():
    progress, out, _ = _progress(every=0.0)  # 0: status only at evaluations
    progress("decoupled", _step(0, 1, 5.0, 1.0))
    progress("decoupled", _step(1, 1, 5.0, 1.0))
    events = [
        {"kind": "chaos", "event": "node_loss", "learner": 1, "duration": 3.0, "factor": 1.0},
        {"kind": "detected", "learner": 1},
        {"kind": "chaos", "event": "freeze", "learner": 0, "duration": 2.0, "factor": 1.0},
        {"kind": "chaos", "event": "link_cut", "learner": 0, "duration": 1.0, "factor": 1.0,
         "skipped": "no proxy"},
        {"kind": "learner_up", "learner": 1},
    ]  # fmt: skip
    for r in events:
        progress("decoupled", {**r, "t": 2.0})
    progress("decoupled", {"kind": "eval", "loss": 4.5, "tokens": 200, "t": 3.0})
    lines = out.getvalue().splitlines()
    assert "learner 1 lost its node (back in 3s)" in lines[0]
    assert "learner 1 is silent" in lines[1]
    assert "learner 0 frozen for 2s" in lines[2]
    assert "not played (no proxy)" in lines[3]
    assert "eval 4.5000" in lines[4] and "0:frozen 1:copying" in lines[4], lines[4]
    progress("decoupled", {"kind": "recovered", "learner": 1, "peer": 0, "bytes": 2_500_000})
    assert "learner 1 recovered from peer 0, 2.5MB" in out.getvalue().splitlines()[-1]


def test_quiet_prints_nothing_and_a_new_method_starts_over():
    out, clock = io.StringIO(), Clock()
    quiet = Progress(100, stream=out, quiet=True, every=1.0, clock=clock)
    clock.now = 5.0
    quiet("decoupled", _step(0, 1, 3.0, 1.0))
    assert out.getvalue() == ""
    progress, out, _ = _progress(every=0.0)
    progress("decoupled", _step(0, 7, 3.0, 1.0))
    progress("data_parallel", {"kind": "eval", "loss": 4.0, "tokens": 0, "t": 0.0})
    assert "tokens           0" in out.getvalue() and "0:s7" not in out.getvalue()


def test_counts_and_durations_read_as_people_write_them():
    assert [human_count(n) for n in (999, 1234, 1.5e6, 2e9)] == ["999", "1.2K", "1.5M", "2.0G"]
    assert [human_seconds(s) for s in (5, 65, 3700)] == ["5s", "1m05s", "1h01m"]


def test_a_hand_started_syncer_counts_the_tokens_it_hears_of_and_says_who_acted():
    progress, out, clock = _progress(every=5.0)
    for i, m in enumerate((0, 1)):
        progress("decoupled", {"kind": "joined", "learner": m, "t": 0.1 * i})
    for i in range(1, 11):  # a syncer's own records: rounds with its token count, no steps
        clock.now = i
        progress("decoupled", {"kind": "round", "answers": 2, "asked": 2, "grace": 0.1,
                               "tokens": 500 * i, "t": float(i)})  # fmt: skip
    progress("decoupled", {"kind": "operator", "action": "kill", "learner": 1, "client": "::1"})
    lines = out.getvalue().splitlines()
    assert "tokens       5,000 ( 50.0%)" in lines[-2] and "0:up 1:up" in lines[-2], lines
    assert "ETA" in lines[-2] and "rounds 10" in lines[-2]
    assert "operator at ::1: kill learner 1 (status page)" in lines[-1]
    progress("decoupled", {"kind": "detected", "learner": 1, "t": 11.0})
    clock.now = 16
    progress("decoupled", {"kind": "joined", "learner": 1, "step": 300, "t": 16.0})  # let in
    assert "t=    16.0  learner 1 joined again at step 300\n" in out.getvalue()
    progress("decoupled", {"kind": "eval", "loss": 3.0, "tokens": 6000, "t": 16.0})
    assert "0:up 1:up" in out.getvalue().splitlines()[-1]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_status_is_one_live_line_below_the_events(monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # (a narrower terminal gets the line cut to fit)
    out, clock = Terminal(), Clock()
    progress = Progress(10_000, stream=out, every=1.0, clock=clock)
    for i in range(1, 4):
        clock.now = float(i)
        progress("decoupled", _step(0, i, 4.0, float(i)))
    progress("decoupled", {"kind": "detected", "learner": 1, "t": 3.5})
    clock.now = 4.0
    progress("decoupled", _step(0, 4, 4.0, 4.0))
    progress.close()
    screen = out.getvalue()
    assert screen.count("\n") == 2  # the event, and the end: status lines replace each other
    lines = screen.split("\n")
    assert "learner 1 is silent" in lines[0] and lines[0].startswith("\r\x1b[K")
    assert lines[0].count("\r\x1b[K") == 3  # 2 status lines drawn in place, then the event
    assert lines[1].endswith("0:s4 1:DOWN") and lines[2] == ""  # the last status, redrawn
    assert not Progress(1, stream=io.StringIO()).live  # a file or a CI log: plain lines


def test_on_a_terminal_an_evaluation_status_line_supersedes_the_live_line(monkeypatch):
    # seen in a real run: the live line drawn before the final evaluation stayed on screen
    # below it, an older status as the run's last line
    monkeypatch.setenv("COLUMNS", "300")
    out, clock = Terminal(), Clock()
    progress = Progress(10_000, stream=out, every=1.0, clock=clock)
    for i in range(1, 3):
        clock.now = float(i)
        progress("decoupled", _step(0, i, 4.0, float(i)))
    progress("decoupled", {"kind": "eval", "loss": 3.25, "tokens": 200, "t": 2.5})
    progress.close()
    screen = out.getvalue()
    assert screen.endswith("eval 3.2500  0:s2\n"), repr(screen[-120:])  # the last line stays
    last = screen.split("\n")[-2].split("\r\x1b[K")[-1]  # what the terminal shows last
    assert "eval 3.2500" in last and screen.count("\n") == 1  # no stale live line after it


def test_a_resumed_run_counts_on_from_where_it_stood_with_an_eta_from_this_launchs_pace():
    # seen: "30,720 (2.6%) ETA 9m01s" at 692K of 1.2M tokens after --resume
    out, clock = io.StringIO(), Clock()
    progress = Progress(1_200_000, stream=out, every=5.0, clock=clock, resumed=True)
    progress("decoupled", {"kind": "restored", "versions": [3], "tokens": 692_000, "t": 50.0})
    for i in range(1, 11):  # 1,000 tokens a wall second in this launch
        clock.now = float(i)
        progress("decoupled", {**_step(0, 100 + i, 3.0, 50.0 + i), "batch_tokens": 1_000})
    last = out.getvalue().splitlines()[-1]
    assert "tokens     702,000 ( 58.5%)" in last and "1.0K tok/s" in last, last
    assert "ETA 8m18s" in last, last  # 498,000 tokens left at 1,000/s: not from zero
    # a syncer restarted later in the same launch restores what it had: no count again
    progress("decoupled", {"kind": "restored", "versions": [4], "tokens": 701_000, "t": 61.0})
    clock.now = 16.0
    progress("decoupled", {**_step(0, 111, 3.0, 66.0), "batch_tokens": 1_000})
    assert "tokens     703,000" in out.getvalue().splitlines()[-1]


def test_a_fresh_run_ignores_a_syncer_restore_and_a_later_torchrun_attempt():
    progress, out, clock = _progress(every=5.0)
    progress("decoupled", _step(0, 1, 3.0, 1.0))
    progress("decoupled", {"kind": "restored", "versions": [1], "tokens": 5_000, "t": 2.0})
    progress("data_parallel", {"kind": "resumed", "attempt": 1, "step": 3, "tokens": 900})
    clock.now = 5.0
    progress("data_parallel", _step(0, 4, 3.0, 5.0))
    assert "tokens         100 (  1.0%)" in out.getvalue().splitlines()[-1]


def test_on_the_simulated_clock_the_virtual_rate_is_labelled_and_the_eta_is_the_whole_runs():
    # seen in the demo: an ETA of one method, read as the run's, beside a wall-clock prefix
    out, clock = io.StringIO(), Clock()
    methods = ["decoupled", "data_parallel"]
    progress = Progress(10_000, stream=out, every=5.0, clock=clock, methods=methods, virtual=True)
    progress("decoupled", {"kind": "eval", "loss": 5.0, "tokens": 0, "t": 0.0})
    for i in range(1, 11):  # 100 tokens a wall second, 10 virtual seconds a step
        clock.now = float(i)
        progress("decoupled", _step(0, i, 4.0, 10.0 * i))
    last = out.getvalue().splitlines()[-1]
    assert "100 tok/s  virtual 10 tok/s" in last, last
    # 1,000 of the run's 20,000 tokens in 10 wall seconds: 190 s left, both methods
    assert "ETA 3m10s (wall, 2 methods)" in last, last
    for i in range(11, 111):  # decoupled ends at its budget; data-parallel starts
        clock.now = float(i)
        progress("decoupled", _step(0, i, 4.0, 10.0 * i))
    clock.now = 115.0
    progress("data_parallel", {**_step(0, 1, 4.0, 1.0), "batch_tokens": 5_000})
    progress("data_parallel", {"kind": "eval", "loss": 4.0, "tokens": 5_000, "t": 1.0})
    last = out.getvalue().splitlines()[-1]
    assert "data_parallel" in last and "ETA 38s (wall)" in last, last  # 15,000 of 20,000 done
    wall = Progress(10_000, stream=io.StringIO(), clock=clock, methods=methods)
    clock.now = 200.0
    wall("decoupled", _step(0, 1, 4.0, 1.0))
    wall.status()
    assert "virtual" not in wall.stream.getvalue() and "(2 methods)" in wall.stream.getvalue()


def test_a_resumed_simulated_run_counts_its_finished_methods_out_of_the_eta():
    out, clock = io.StringIO(), Clock()
    progress = Progress(
        10_000, stream=out, every=0.0, clock=clock, methods=["decoupled", "data_parallel"],
        virtual=True, resumed=True, starts={"decoupled": 10_000, "data_parallel": 6_000},
    )  # fmt: skip
    progress("decoupled", {"kind": "resume", "tokens": 10_000, "finished": True, "t": 90.0})
    progress("data_parallel", {"kind": "resume", "tokens": 6_000, "finished": False, "t": 40.0})
    clock.now = 10.0
    progress("data_parallel", {**_step(0, 61, 3.0, 41.0), "batch_tokens": 1_000})
    progress("data_parallel", {"kind": "eval", "loss": 3.0, "tokens": 7_000, "t": 41.0})
    last = out.getvalue().splitlines()[-1]
    assert "tokens       7,000 ( 70.0%)" in last and "ETA 30s (wall)" in last, last


def test_a_rounds_answers_read_true_when_late_answers_ride_along():
    progress, out, _ = _progress(every=0.0)
    late = {"kind": "round", "answers": 3, "asked": 2, "grace": 0.5, "weights": {"0": 1, "1": 1}}
    progress("decoupled", {**late, "t": 1.0})
    progress("decoupled", {"kind": "eval", "loss": 4.0, "tokens": 0, "t": 1.0})
    assert "rounds 1 (last 3 answers from 2 learners, 2 asked, grace 0.50s)" in out.getvalue()
    fresh = {"kind": "round", "answers": 2, "asked": 3, "grace": 0.5, "weights": {"0": 1, "2": 1}}
    progress("decoupled", {**fresh, "t": 2.0})
    progress("decoupled", {"kind": "eval", "loss": 4.0, "tokens": 0, "t": 2.0})
    assert "rounds 2 (last 2/3 answered, grace 0.50s)" in out.getvalue().splitlines()[-1]


def test_a_time_limit_that_ends_the_run_before_its_budget_sets_the_eta():
    # seen: "ETA 55m" in a run whose 70 s limit (train.max_virtual_seconds) ended it in 70 s
    out, clock = io.StringIO(), Clock()
    methods = ["decoupled", "data_parallel"]
    progress = Progress(
        100_000, stream=out, every=5.0, clock=clock, methods=methods, limit_seconds=70.0
    )
    progress("decoupled", {"kind": "eval", "loss": 5.0, "tokens": 0, "t": 0.0})
    for i in range(1, 11):  # 100 tokens a second: 1% of the budget, 1/7 of the limit
        clock.now = float(i)
        progress("decoupled", _step(0, i, 4.0, float(i)))
    last = out.getvalue().splitlines()[-1]
    # 10 of 70 s gone: the same again for each 1/7, two methods: 10 s x 13 left
    assert "ETA 2m10s (2 methods)" in last, last
    for i in range(11, 71):  # the limit ends decoupled at 7% of its tokens
        clock.now = float(i)
        progress("decoupled", _step(0, i, 4.0, float(i)))
    clock.now = 75.0
    progress("data_parallel", {"kind": "eval", "loss": 5.0, "tokens": 0, "t": 0.0})
    progress("data_parallel", _step(0, 1, 4.0, 5.0))  # 5 s of data-parallel's 70
    progress("data_parallel", {"kind": "eval", "loss": 4.0, "tokens": 100, "t": 5.0})
    last = out.getvalue().splitlines()[-1]
    # decoupled counted as done: 75 s for 1 + 1/14 of a method, 13/14 of one left
    assert "data_parallel" in last and "ETA 1m05s" in last, last
