"""Live progress on the terminal: a status line every few seconds, and every event as it
happens.

Fed the same records as ``metrics.jsonl`` (``ddiloco train`` calls it with each), so what
the terminal says is what the run directory holds. A status line (every
``report.progress_seconds`` of wall time, and at each evaluation) says, for the method
running: its clock (``t``: virtual seconds on the simulated clock, wall seconds on real
processes), tokens trained with the share of the budget (a resumed run's count goes on from
where it stood), tokens per wall second since the last line (on the simulated clock also the
``virtual`` tokens per simulated second, labelled so), the wall-clock ETA of the whole run
(every method it still trains: wall time since this launch started, over the share of the
work left at its start that is done), the train loss (an exponential moving average over
every learner's steps), merged rounds with the last round's answers and grace window, and
each learner's state:

``up`` (stepping; ``s<step>`` in the line), ``DOWN`` (crashed, lost its node, preempted,
detected silent or exited), ``frozen``, ``joining`` (a slot asked for, not up yet),
``copying`` (recovering from a peer or the syncer), ``left`` (gone cleanly).

Event lines (chaos, detections, recoveries, a learner or the syncer up again, exits,
rollbacks) print as they arrive. ``quiet`` prints nothing. On a terminal the periodic status
line is a live line redrawn in place below the event and evaluation lines; anywhere else
(a file, a CI log) every line is a plain line of its own.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

CLEAR_LINE = "\r\033[K"  # back to the line's start, erase it
LOSS_EMA = 0.05  # weight of each new step's loss in the moving average
DOWN_EVENTS = {"crash": "crashed", "node_loss": "lost its node", "preempt": "was preempted"}


def human_count(n: float) -> str:
    """1234 -> 1.2K, 1.5e6 -> 1.5M (tokens, tokens per second)."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def human_seconds(s: float) -> str:
    """65 -> 1m05s, 3700 -> 1h01m."""
    s = max(0, int(s))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class Progress:
    """What a user watching the run sees (see the module). Call it with every record."""

    def __init__(
        self,
        total_tokens: int,
        stream: TextIO | None = None,
        quiet: bool = False,
        every: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        live: bool | None = None,
        *,
        methods: Sequence[str] = (),
        virtual: bool = False,
        resumed: bool = False,
        starts: Mapping[str, int] | None = None,
        limit_seconds: float = 0.0,
    ) -> None:
        """``methods``: every method the run trains, in order (the ETA covers them all);
        ``virtual``: the records' ``t`` is the simulated clock; ``resumed``: this launch
        continues a run (its first resume, restore or resumed record says where each method
        stood); ``starts``: the tokens each method holds at this launch's start, where known
        before it begins (a simulated resume's checkpoints); ``limit_seconds``: where each
        method's clock stops it whatever its tokens (``train.max_virtual_seconds``; 0: none),
        so the ETA counts the share of that time gone when it is larger than the tokens'."""
        self.total = total_tokens
        self.stream = stream or sys.stdout  # (the one at the start, redirected or not)
        self.quiet = quiet
        self.every = every  # 0: status lines only at evaluations
        self.clock = clock
        # a terminal gets a live status line redrawn in place; a file or a CI log plain lines
        self.live = self.stream.isatty() if live is None else live
        self.pinned = ""  # the live line on screen
        self.started = clock()  # (the wall ETA: time since then, over the share done)
        self.method = ""
        self.methods = list(methods)
        self.virtual = virtual
        self.resumed = resumed
        self.limit = limit_seconds
        self.bases: dict[str, int] = dict(starts or {})  # method -> tokens at this launch's start
        self.done: dict[str, int] = {}  # a method this launch trained to its end -> its tokens
        self.handlers: dict[str, Callable[[dict[str, Any]], None]] = {
            "step": self._on_step,
            "round": self._on_round,
            "eval": self._on_eval,
            "chaos": self._on_chaos,
            "detected": self._on_detected,
            "recovered": self._on_recovered,
            "caught_up": self._on_recovered,  # a late first start copies a peer the same way
            "learner_up": self._on_learner_up,
            "joined": self._on_joined,
            "operator": self._on_operator,
            "left": self._on_left,
            "syncer_up": self._on_syncer_up,
            "restored": self._on_restored,
            "exited": self._on_exited,
            "rollback": self._on_rollback,
            "resume": self._on_resume,
            "resumed": self._on_resume,
        }
        self._reset()

    def _reset(self) -> None:
        self.learners: dict[int, str] = {}
        self.steps: dict[int, int] = {}
        self.base = self.bases.get(self.method, 0)  # tokens at this launch's start
        self.based = False  # a record said where this method stood (a resumed run)
        self.counted = 0  # tokens of the steps seen in this launch
        self.heard = 0  # the syncer's own count (a hand-started syncer's records: no steps)
        self.tokens = self.base
        self.loss: float | None = None
        self.rounds = 0
        self.last_round = ""
        self.t = 0.0
        self.t_start: float | None = None  # the method's clock at this launch's start
        self.last_line = self.clock()
        self.last_tokens = self.tokens
        self.rate: float | None = None

    def __call__(self, method: str, record: dict[str, Any]) -> None:
        if method != self.method:
            self.close()  # (a method's last live line stays on screen)
            if self.method:
                self.done[self.method] = self._done_counted()
            self.method = method
            self._reset()
        self.t = float(record.get("t", self.t))
        if self.t_start is None and "t" in record:
            self.t_start = self.t
        handler = self.handlers.get(str(record["kind"]))
        if handler is not None:
            handler(record)
        if self.every and self.clock() - self.last_line >= self.every:
            self.status()

    # -- what each record changes -------------------------------------------------------------
    def _count(self) -> None:
        self.tokens = max(self.base + self.counted, self.heard)

    def _on_step(self, r: dict[str, Any]) -> None:
        m = r["learner"]
        self.learners[m] = "up"
        self.steps[m] = r["step"]
        self.counted += int(r.get("batch_tokens", 0))
        self._count()
        if r.get("loss") is None:  # (an own loop may not say its loss)
            return
        loss = float(r["loss"])
        self.loss = loss if self.loss is None else (1 - LOSS_EMA) * self.loss + LOSS_EMA * loss

    def _on_round(self, r: dict[str, Any]) -> None:
        self.rounds += 1
        self._heard_tokens(r)
        self.last_round = f"last {round_answers(r)}, grace {r['grace']:.2f}s"

    def _heard_tokens(self, r: dict[str, Any]) -> None:
        """A syncer's own records (no steps): the tokens it heard of, from rounds and evals."""
        if not self.steps and "tokens" in r:
            self.heard = max(self.heard, int(r["tokens"]))
            self._count()

    def _on_resume(self, r: dict[str, Any]) -> None:
        """Where a resumed method stood: the simulated clock's ``resume`` record, the
        processes' syncer restored from its store, the data-parallel job's first attempt
        resumed from its checkpoint. Its tokens count from there on (once a launch: a later
        restore within the launch is the syncer's own restart, already counted)."""
        if r["kind"] == "resumed" and r.get("attempt"):  # torchrun restarted the job
            return
        if not self.resumed or self.based or "tokens" not in r:
            return
        shift = int(r["tokens"]) - self.base
        self.base, self.based = int(r["tokens"]), True
        self.bases[self.method] = self.base
        self.last_tokens += shift  # (a count going on, not tokens trained since the last line)
        self._count()

    def _on_eval(self, r: dict[str, Any]) -> None:
        self._heard_tokens(r)
        self.status(f"eval {r['loss']:.4f}")

    def _on_chaos(self, r: dict[str, Any]) -> None:
        m, kind = r["learner"], r["event"]
        if "skipped" in r:
            self.say(f"chaos {kind} on learner {m}: not played ({r['skipped']})")
            return
        lasting = f" for {r['duration']:.0f}s" if r.get("duration") else ""
        if kind in DOWN_EVENTS:
            self.learners[m] = "DOWN"
            back = f" (back in {r['duration']:.0f}s)" if r.get("duration") else ""
            self.say(f"learner {m} {DOWN_EVENTS[kind]}{back}")
        elif kind == "freeze":
            self.learners[m] = "frozen"
            self.say(f"learner {m} frozen{lasting}")
        elif kind == "leave":
            self.say(f"learner {m} asked to leave")
        elif kind == "join":
            self.learners.setdefault(m, "joining")
            self.say(f"learner {m} joining (a scavenged slot)")
        elif kind == "syncer_crash":
            self.say(f"syncer killed (back in {r['duration']:.0f}s)")
        else:  # slow, link_slow, link_cut
            factor = f" x{r['factor']:g}" if r.get("factor", 1.0) != 1.0 else ""
            self.say(f"chaos {kind}{factor} on learner {m}{lasting}")

    def _on_detected(self, r: dict[str, Any]) -> None:
        self.learners[r["learner"]] = "DOWN"
        self.say(f"syncer: learner {r['learner']} is silent: given up on until it returns")

    def _on_recovered(self, r: dict[str, Any]) -> None:
        src = r.get("source") or ("syncer" if r.get("peer") is None else f"peer {r['peer']}")
        copied = f", {human_count(r['bytes'])}B" if r.get("bytes") else ""
        self.learners[r["learner"]] = "up"
        self.say(f"learner {r['learner']} recovered from {src}{copied}")

    def _on_learner_up(self, r: dict[str, Any]) -> None:
        m = r["learner"]
        if self.learners.get(m) in ("DOWN", "joining"):
            self.learners[m] = "copying"

    def _on_joined(self, r: dict[str, Any]) -> None:
        """The syncer let a learner in (all a hand-started syncer hears of its learners):
        up, whatever it was before (a restart that was DOWN, a slot that was joining). One
        that was DOWN is said (under ``ddiloco train`` its restart went through ``copying``
        and said ``recovered``)."""
        m = r["learner"]
        if self.learners.get(m) == "DOWN":
            self.say(f"learner {m} joined again at step {int(r.get('step', 0)):,}")
        self.learners[m] = "up"

    def _on_operator(self, r: dict[str, Any]) -> None:
        self.say(f"operator at {r['client']}: {r['action']} learner {r['learner']} (status page)")

    def _on_left(self, r: dict[str, Any]) -> None:
        self.learners[r["learner"]] = "left"
        self.say(f"learner {r['learner']} left")

    def _on_syncer_up(self, r: dict[str, Any]) -> None:
        if self.rounds:  # (the first one is the start)
            self.say("syncer up again")
        if r.get("address"):  # a hand-started syncer: where its learners must point
            self.say(f"syncer for run {r.get('run_id', '?')} listening on {r['address']}")
        if r.get("status_url"):
            self.say(f"syncer status: {r['status_url']} (also status.json, metrics)")
            if r.get("actions"):
                where = (
                    f"the file {r['secret_file']}"
                    if r.get("secret_file")
                    else "$DDILOCO_SECRET; ddiloco train writes it to RUN/processes/run.secret"
                )
                self.say(f"  its kill / leave buttons take the run secret ({where})")

    def _on_restored(self, r: dict[str, Any]) -> None:
        self._on_resume(r)
        self.say(f"syncer restored from its store: versions {r.get('versions')}")

    def _on_exited(self, r: dict[str, Any]) -> None:
        process = str(r.get("process", ""))
        if process.startswith("learner-") and r.get("code"):
            self.learners[int(process.split("-")[1])] = "DOWN"
        # (a failure's own line, with what happens next, goes to stderr: commands/train.py)

    def _on_rollback(self, r: dict[str, Any]) -> None:
        self.say(f"rollback to the last checkpoint: {human_count(r['tokens_lost'])} tokens lost")

    # -- lines ------------------------------------------------------------------------------
    def status(self, extra: str = "") -> None:
        """The status line, now."""
        now = self.clock()
        interval = now - self.last_line
        if interval > 0 and self.tokens > self.last_tokens:  # (else: the last pace known)
            self.rate = (self.tokens - self.last_tokens) / interval
        self.last_line, self.last_tokens = now, self.tokens
        parts = [f"tokens {self.tokens:>11,} ({100.0 * self.tokens / max(1, self.total):5.1f}%)"]
        if self.rate:
            parts.append(f"{human_count(self.rate)} tok/s")
        if self.virtual and self.t_start is not None and self.t > self.t_start:
            virtual = (self.tokens - self.base) / (self.t - self.t_start)
            if virtual > 0:
                parts.append(f"virtual {human_count(virtual)} tok/s")
        eta = self.eta(now)
        if eta is not None:
            parts.append(eta)
        if self.loss is not None:
            parts.append(f"loss {self.loss:.3f}")
        if extra:
            parts.append(extra)
        if self.rounds:
            parts.append(f"rounds {self.rounds} ({self.last_round})")
        if self.learners:
            parts.append(" ".join(self._state(m) for m in sorted(self.learners)))
        if extra:  # a status line that stays (an evaluation's) supersedes the live one
            self.pinned = ""
        self.say("  ".join(parts), transient=not extra)

    def _done_now(self) -> int:
        """Tokens the running method trained in this launch, up to the budget."""
        return max(0, min(self.tokens, self.total) - min(self.base, self.total))

    def _done_counted(self) -> int:
        """:meth:`_done_now`, or the tokens of the same share of what this launch had left
        when a time limit's share gone is larger (a run the limit ends before its budget)."""
        done = self._done_now()
        if self.limit <= 0 or self.t_start is None or self.limit <= self.t_start:
            return done
        share = min(1.0, (self.t - self.t_start) / (self.limit - self.t_start))
        left = max(0, self.total - min(self.base, self.total))
        return max(done, int(share * left))

    def eta(self, now: float) -> str | None:
        """The wall-clock ETA of the run: wall time since this launch started, scaled by the
        work left over the work done, in tokens of every method this launch trains (None
        before any is done)."""
        methods = [*self.methods, *([self.method] if self.method not in self.methods else [])]
        left = {m: max(0, self.total - min(self.bases.get(m, 0), self.total)) for m in methods}
        done = sum(self.done.values()) + self._done_counted()
        if done <= 0 or now <= self.started:
            return None
        remaining = max(0, sum(left.values()) - done)
        to_train = sum(1 for m in methods if left[m] and m not in self.done)
        label = ["wall"] if self.virtual else []
        if to_train > 1:
            label.append(f"{to_train} methods")
        said = f" ({', '.join(label)})" if label else ""
        return f"ETA {human_seconds((now - self.started) * remaining / done)}{said}"

    def _state(self, m: int) -> str:
        state = self.learners[m]
        return f"{m}:s{self.steps[m]}" if state == "up" and m in self.steps else f"{m}:{state}"

    def say(self, text: str, transient: bool = False) -> None:
        """One line; on a terminal a ``transient`` one (a periodic status) is the live line,
        redrawn in place under the lines that stay (events, evaluations)."""
        if self.quiet:
            return
        wall = self.clock() - self.started
        line = f"[{wall:6.1f}s] {self.method:<14} t={self.t:8.1f}  {text}"
        if not self.live:
            print(line, file=self.stream, flush=True)
            return
        width = max(20, shutil.get_terminal_size().columns - 1)  # (a wrapped line cannot be
        if transient:  # redrawn in place)
            self.pinned = line[:width]
            self.stream.write(CLEAR_LINE + self.pinned)
        else:
            self.stream.write(CLEAR_LINE + line + "\n" + self.pinned)
        self.stream.flush()

    def close(self) -> None:
        """End the live line (the next output starts on a line of its own)."""
        if self.live and self.pinned and not self.quiet:
            self.stream.write("\n")
            self.stream.flush()
        self.pinned = ""


def round_answers(r: dict[str, Any]) -> str:
    """A round's answers in words that stay true when late answers (on an older base) ride
    along or an asked learner left before the merge: ``3/4 answered`` when each answer is
    a different asked learner's, else ``5 answers from 3 learners, 4 asked``."""
    answers, asked = int(r["answers"]), int(r["asked"])
    learners = len(r["weights"]) if isinstance(r.get("weights"), dict) else answers
    if answers == learners <= asked:
        return f"{answers}/{asked} answered"
    return f"{answers} answers from {learners} learners, {asked} asked"


def terminal_sink(
    total_tokens: int, every: float, method: str
) -> Callable[[dict[str, Any]], None] | None:
    """For a ``ddiloco syncer`` or ``learner`` started by hand on a terminal: its events as
    progress lines instead of ``@event`` records (None when stdout is not a terminal: then a
    supervisor or a log reads the records)."""
    if not sys.stdout.isatty():
        return None
    progress = Progress(total_tokens, every=every)
    return lambda record: progress(method, record)
