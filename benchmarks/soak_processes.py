"""Soak: many SIGKILLs of learners and the syncer, then an audit for lost or doubled updates.

Runs ``decoupled`` as real processes on loopback (gpt-tiny, 3 learners) and, driven by the
processes' own events, kills a random learner (restarted after ``--down`` seconds: it recovers
from a peer) every ``--every`` learner steps, and the syncer on every ``--syncer-every``-th
kill (restarted from its durable store). A learner is only killed while another one is up,
so recovery from a peer is always possible. After ``--kills`` kills the run is stopped and
audited from the syncer's journal:

- lost: a merge that was broadcast (acknowledged) but is missing from the durable state;
- doubled: an answer merged twice, or a fragment version that appears twice or out of order;
- the durable fragments must equal a recomputation from Theta_0 and the journal;
- the token ledger must balance with no contradicting call, across the syncer restarts
  (the run's summary), and the durable ledger snapshot must balance too.

    .venv/bin/python benchmarks/soak_processes.py --kills 50
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ddiloco.config import load_config
from ddiloco.core.ledger import TokenLedger
from ddiloco.runtime.processes.launcher import Launcher
from ddiloco.runtime.processes.store import SyncerStore, recompute

OVERRIDES = [
    "model='gpt-tiny'", "methods=['decoupled']", "runtime='processes'", "train.learners=3",
    "train.batch_size=4", "train.tokens=1000000000", "train.eval_every=1000000",
    "sync.fragments=4", "sync.sync_every=8", "data.eval_batches=1",
    "processes.journal=true", "processes.detect_seconds=3.0", "processes.max_wall_seconds=3600",
]  # fmt: skip


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.kills = 0
        self.syncer_kills = 0
        self.steps_since = 0
        self.up: set[int] = set()
        self.acked: dict[int, int] = {}  # fragment -> highest version broadcast
        self.recovered_from: dict[str, int] = {"peer": 0, "syncer": 0}
        self.stopping = False

    def hook(self, launcher: Launcher, r: dict[str, Any]) -> None:
        kind = r["kind"]
        if kind == "round":
            self.acked[r["fragment"]] = max(self.acked.get(r["fragment"], 0), r["version"])
        elif kind == "learner_up":
            self.up.add(r["learner"])
        elif kind == "recovered":
            self.recovered_from["peer" if r["peer"] is not None else "syncer"] += 1
        elif kind == "step" and not self.stopping:
            self.up.add(r["learner"])
            self.steps_since += 1
            if self.steps_since >= self.args.every:
                self.steps_since = 0
                self.kill(launcher)

    def kill(self, launcher: Launcher) -> None:
        if self.kills >= self.args.kills:
            self.stopping = True
            launcher.request_stop()
            return
        self.kills += 1
        if self.kills % self.args.syncer_every == 0:
            self.syncer_kills += 1
            launcher.crash_syncer(self.args.down)
        elif len(self.up) >= 2:
            m = self.rng.choice(sorted(self.up))
            self.up.discard(m)
            launcher.play_crash(m, self.args.down)
        else:
            self.kills -= 1  # nobody to recover from yet: wait
        print(f"[{launcher.now():7.1f}s] kills {self.kills} (syncer {self.syncer_kills})",
              flush=True)  # fmt: skip


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
    return {"merges": sum(r.version for r in records.values()), "answers_merged": len(merged),
            "lost": lost, "doubled": doubled, "recomputed_equal": equal,
            "durable_ledger_balanced": durable_ledger}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--every", type=int, default=40, help="learner steps between kills")
    parser.add_argument("--syncer-every", type=int, default=10, help="every Nth kill: syncer")
    parser.add_argument("--down", type=float, default=0.5, help="seconds before a restart")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="run directory (default: a temp dir)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="ddiloco-soak-"))
    config = load_config(None, OVERRIDES)
    soak = Soak(args)
    launcher = Launcher(config, "decoupled", out, lambda r: None)
    launcher.hooks.append(soak.hook)
    started = time.monotonic()
    summary = launcher.run()
    result = audit(config, out / "processes" / "syncer_state", soak.acked)
    print(f"wall {time.monotonic() - started:.0f}s, kills {soak.kills} "
          f"(syncer {soak.syncer_kills}), recovered {soak.recovered_from}")  # fmt: skip
    print(f"merges {result['merges']}, answers merged {result['answers_merged']}, "
          f"lost {result['lost']}, doubled {result['doubled']}, "
          f"recomputed == durable: {result['recomputed_equal']}, "
          f"refused frames {summary['refused']}")  # fmt: skip
    print(f"ledger balanced {summary['ledger_balanced']}, errors {summary['ledger_errors']}, "
          f"durable snapshot balanced {result['durable_ledger_balanced']}, "
          f"restart reconciliation {summary.get('ledger_restart')}, "
          f"tokens {summary['tokens']}, merged {summary['tokens_merged']:.0f}, "
          f"wasted {summary['tokens_wasted']}")  # fmt: skip
    ok = result["lost"] == 0 and result["doubled"] == 0 and result["recomputed_equal"]
    ok = ok and summary["ledger_balanced"] and result["durable_ledger_balanced"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
