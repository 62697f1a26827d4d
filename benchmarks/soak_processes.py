"""Soak: many SIGKILLs of learners and the syncer, then an audit for lost or doubled updates.

Runs ``decoupled`` as real processes on loopback (gpt-tiny, 3 learners) and, driven by the
processes' own events, kills a random learner (restarted after ``--down`` seconds: it recovers
from a peer) every ``--every`` learner steps, and the syncer on every ``--syncer-every``-th
kill (restarted from its durable store). A learner is only killed while another one is up,
so recovery from a peer is always possible; nothing is killed until the syncer's current
life has merged a round, and the run is not stopped until every killed learner has
recovered too, so every restart is shown to work. After ``--kills`` kills the run is stopped
and audited from the syncer's journal:

- every planned kill happened: ``--kills // --syncer-every`` of the syncer (a plan with
  none is refused unless ``--syncer-every 0`` asks for none), the rest of learners;
- every syncer life after a kill merged rounds and every killed learner recovered (each
  within ``--merge-timeout`` seconds), and the run merged something;

- lost: a merge that was broadcast (acknowledged) but is missing from the durable state;
- doubled: an answer merged twice, or a fragment version that appears twice or out of order;
- the durable fragments must equal a recomputation from Theta_0 and the journal;
- the token ledger must balance with no contradicting call, across the syncer restarts
  (the run's summary), and the durable ledger snapshot must balance too.

    .venv/bin/python benchmarks/soak_processes.py --kills 50
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ddiloco.config import load_config
from ddiloco.core.ledger import TokenLedger
from ddiloco.errors import DDiLoCoError
from ddiloco.runtime.processes.launcher.fragments import RELAYED, Launcher
from ddiloco.runtime.processes.syncer.store import SyncerStore, recompute

OVERRIDES = [
    "model='gpt-tiny'",
    "methods=['decoupled']",
    "runtime='processes'",
    "train.learners=3",
    "train.batch_size=4",
    "train.tokens=1000000000",
    "train.eval_every=1000000",
    "sync.fragments=4",
    "sync.sync_every=8",
    "data.eval_batches=1",
    "processes.journal=true",
    "processes.detect_seconds=3.0",
    "processes.max_wall_seconds=3600",
]


def planned(args: argparse.Namespace) -> tuple[int, int]:
    """(learner kills, syncer kills) the arguments plan: every ``syncer_every``-th is the
    syncer's."""
    syncer = args.kills // args.syncer_every if args.syncer_every else 0
    return args.kills - syncer, syncer


class Soak:
    """Kills driven by the processes' events; counts only kills that happened (a signal
    that reached a live process, as the launcher's ``chaos`` records say)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.kills = 0  # planned kills done, in order
        self.done = {"learner": 0, "syncer": 0}  # from the launcher's chaos records
        self.steps_since = 0
        self.up: set[int] = set()
        self.acked: dict[int, int] = {}  # fragment -> highest version broadcast
        self.recovered_from: dict[str, int] = {"peer": 0, "syncer": 0}
        self.stopping = False
        self.lives: list[int] = []  # rounds merged by each syncer life after a kill
        self.syncer_up = False
        self.since = 0.0  # when the current syncer life was killed into (monotonic)
        self.pending: dict[int, float] = {}  # killed learner -> when (monotonic)
        self.recoveries = 0  # of killed learners
        self.failure = ""

    def record(self, r: dict[str, Any]) -> None:
        """The launcher's own records (emit): kills that happened."""
        if r["kind"] == "chaos" and not r.get("skipped"):
            if r["event"] == "syncer_crash":
                self.done["syncer"] += 1
            elif r["event"] == "crash":
                self.done["learner"] += 1

    def hook(self, launcher: Launcher, r: dict[str, Any]) -> None:
        kind = r["kind"]
        if kind == "round":
            self.acked[r["fragment"]] = max(self.acked.get(r["fragment"], 0), r["version"])
            if self.lives:
                self.lives[-1] += 1
        elif kind == "syncer_up":
            self.syncer_up = True
        elif kind == "learner_up":
            self.up.add(r["learner"])
        elif kind == "recovered":
            self.recovered_from["peer" if r["peer"] is not None else "syncer"] += 1
            if self.pending.pop(r["learner"], None) is not None:
                self.recoveries += 1
        elif kind == "step" and not self.stopping:
            self.up.add(r["learner"])
            self.steps_since += 1
            if self.steps_since >= self.args.every and self.kill(launcher):
                self.steps_since = 0
        now, limit = time.monotonic(), self.args.merge_timeout
        if self.lives and self.lives[-1] == 0 and now - self.since > limit:
            self.fail(launcher, f"no round merged {limit:.0f}s after syncer kill {len(self.lives)}")
        late = [m for m, at in self.pending.items() if now - at > limit]
        if late:
            self.fail(launcher, f"learner(s) {late} not recovered {limit:.0f}s after their kill")

    def fail(self, launcher: Launcher, why: str) -> None:
        if not self.failure:
            self.failure = why
            self.stopping = True
            launcher.request_stop()

    def kill(self, launcher: Launcher) -> bool:
        """The next planned kill, or the stop after the last; False: not yet (try again at
        the next step)."""
        if (self.lives and self.lives[-1] == 0) or not self.syncer_up:
            return False  # the restarted syncer has not merged yet: wait for it
        if self.kills >= self.args.kills:
            if self.pending:
                return False  # a killed learner has not recovered yet
            self.stopping = True
            launcher.request_stop()
            return True
        if self.args.syncer_every and (self.kills + 1) % self.args.syncer_every == 0:
            before = self.done["syncer"]
            launcher.crash_syncer(self.args.down)
            if self.done["syncer"] == before:
                return False  # it was not running: try again later
            self.syncer_up = False
            self.lives.append(0)
            self.since = time.monotonic()
        elif len(self.up) >= 2:
            m = self.rng.choice(sorted(self.up))
            before = self.done["learner"]
            launcher.play_crash(m, self.args.down)
            if self.done["learner"] == before:
                return False  # it was down already
            self.up.discard(m)
            self.pending[m] = time.monotonic()
        else:
            return False  # nobody to recover from yet: wait
        self.kills += 1
        print(
            f"[{launcher.now():7.1f}s] kills {self.kills} (syncer {self.done['syncer']})",
            flush=True,
        )
        return True

    def verdict(self, merges: int) -> list[str]:
        """Why the soak failed ([] if it passed): a planned kill missing, a killed learner
        not recovered, a syncer life after a kill that merged nothing, no merge at all."""
        learner, syncer = planned(self.args)
        problems = [self.failure] if self.failure else []
        if self.done["learner"] != learner:
            problems.append(f"learner kills {self.done['learner']} != planned {learner}")
        if self.done["syncer"] != syncer:
            problems.append(f"syncer kills {self.done['syncer']} != planned {syncer}")
        if self.recoveries != self.done["learner"]:
            problems.append(
                f"{self.recoveries} recoveries of {self.done['learner']} killed learners"
            )
        empty = [i + 1 for i, rounds in enumerate(self.lives) if rounds == 0]
        if empty:
            problems.append(f"no round merged after syncer kill(s) {empty}")
        if merges == 0:
            problems.append("no merge in the whole run")
        return problems


def audit(config: Any, store_dir: Path, acked: dict[int, int]) -> dict[str, Any]:
    store = SyncerStore(store_dir)
    records = store.load()
    fragments, merged = recompute(config, store)
    lost = sum(max(0, v - records[p].version if p in records else v) for p, v in acked.items())
    doubled = sum(n - 1 for n in merged.values() if n > 1)
    equal = all(  # bit for bit: the syncer merges with 1 thread, and so does this audit
        torch.equal(a, b)
        for p, rec in records.items()
        for a, b in zip(fragments[p], rec.values, strict=True)
    )
    state = store.ledger_state
    durable_ledger = state is not None and TokenLedger.from_state(state).balanced()
    return {
        "merges": sum(r.version for r in records.values()),
        "answers_merged": len(merged),
        "lost": lost,
        "doubled": doubled,
        "recomputed_equal": equal,
        "durable_ledger_balanced": durable_ledger,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--every", type=int, default=40, help="learner steps between kills")
    parser.add_argument(
        "--syncer-every",
        type=int,
        default=None,
        help="every Nth kill: the syncer (default 10; 0: never)",
    )
    parser.add_argument("--down", type=float, default=0.5, help="seconds before a restart")
    parser.add_argument(
        "--merge-timeout",
        type=float,
        default=120.0,
        help="seconds a restarted syncer has to merge a round",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="run directory (default: a temp dir)")
    args = parser.parse_args()
    explicit = args.syncer_every is not None
    args.syncer_every = 10 if args.syncer_every is None else args.syncer_every
    if args.kills < 1 or args.syncer_every < 0:
        parser.error("--kills must be >= 1 and --syncer-every >= 0")
    learner_kills, syncer_kills = planned(args)
    if syncer_kills == 0 and not (explicit and args.syncer_every == 0):
        parser.error(
            f"--kills {args.kills} with --syncer-every {args.syncer_every} plans no "
            "syncer kill: raise --kills, lower --syncer-every, or say --syncer-every "
            "0 to soak the learners alone"
        )
    print(f"planned: {learner_kills} learner kills, {syncer_kills} syncer kills", flush=True)
    out = Path(args.out or tempfile.mkdtemp(prefix="ddiloco-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    config = load_config(None, OVERRIDES)
    soak = Soak(args)
    log = (out / "events.jsonl").open("w", encoding="utf-8")  # every record, to look into

    def record(r: dict[str, Any]) -> None:
        log.write(json.dumps(r, default=str) + "\n")
        soak.record(r)

    launcher = Launcher(config, "decoupled", out, record)

    def hook(launcher: Launcher, r: dict[str, Any]) -> None:
        if r["kind"] not in RELAYED:  # else emit wrote it
            log.write(json.dumps(r, default=str) + "\n")
        soak.hook(launcher, r)

    launcher.hooks.append(hook)
    started = time.monotonic()
    try:
        summary = launcher.run()
    except DDiLoCoError as exc:  # a process gave up, or the run did not end
        print(f"FAIL: {exc}", file=sys.stderr)
        print(getattr(exc, "details", lambda: "")(), file=sys.stderr)
        return 1
    finally:
        log.close()
        print(f"events: {out / 'events.jsonl'}", flush=True)
    result = audit(config, out / "processes" / "syncer_state", soak.acked)
    print(
        f"wall {time.monotonic() - started:.0f}s, kills {soak.kills} (learner "
        f"{soak.done['learner']}, syncer {soak.done['syncer']}), "
        f"rounds after each syncer restart {soak.lives}, "
        f"recovered {soak.recovered_from}"
    )
    print(
        f"merges {result['merges']}, answers merged {result['answers_merged']}, "
        f"lost {result['lost']}, doubled {result['doubled']}, "
        f"recomputed == durable: {result['recomputed_equal']}, "
        f"refused frames {summary['refused']}"
    )
    print(
        f"ledger balanced {summary['ledger_balanced']}, errors {summary['ledger_errors']}, "
        f"durable snapshot balanced {result['durable_ledger_balanced']}, "
        f"restart reconciliation {summary.get('ledger_restart')}, "
        f"tokens {summary['tokens']}, merged {summary['tokens_merged']:.0f}, "
        f"wasted {summary['tokens_wasted']}"
    )
    problems = soak.verdict(result["merges"])
    for key in ("lost", "doubled"):
        if result[key]:
            problems.append(f"{key} {result[key]}")
    if not result["recomputed_equal"]:
        problems.append("durable fragments != recomputed from the journal")
    if not summary["ledger_balanced"] or not result["durable_ledger_balanced"]:
        problems.append("ledger unbalanced")
    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    print("PASS" if not problems else f"FAIL ({len(problems)})", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
