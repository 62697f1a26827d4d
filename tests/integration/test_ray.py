"""The Ray runtime on a real local Ray cluster: a head and worker nodes started as separate
``ray start`` processes on 127.0.0.1, learners as actors that are killed, frozen, placed on
a node that joins (Ray picks which pending learner) and lost with it (the chaos plan's
``node_loss``); every Ray process stopped by PID."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from bases import SMALL
from hooks import kill_syncer_then_stop, kill_then_stop, stop_after_recovery, train_with_hook
from rundir import records

from ddiloco.chaos.plan import ChaosEvent
from ddiloco.config import RunConfig, load_config

RAY = str(Path(sys.executable).with_name("ray"))
# the cluster's processes and this driver share one token (Ray's token authentication); Ray
# reads it when it is imported, so it is set before the import below
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(32),
}
os.environ.update(RAY_ENV)
ray = pytest.importorskip(
    "ray", reason="the Ray runtime needs the extra: pip install 'ddiloco[ray]'"
)
from ddiloco.runtime.processes.ray.launcher import RayLauncher  # noqa: E402  (needs ray)


class LocalCluster:
    """``ray start --block`` processes, each in a session of its own, stopped by the PIDs of
    every process they started (found as their descendants before any is killed).

    Ray refuses a loopback node address for a cluster of several nodes (it resolves
    127.0.0.1 to the machine's address), so Ray's own sockets use this machine's address;
    ddiloco's services bind 127.0.0.1 (``ray.service_host``)."""

    def __init__(self, root: Path) -> None:
        self.temp = Path(f"/tmp/rt-{secrets.token_hex(3)}")  # short: unix socket paths
        self.port = 0
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}
        self.seen: dict[str, set[int]] = {}  # every pid found under each node
        self.logs = root

    def start(self, name: str, cpus: int, resources: dict[str, float] | None = None) -> None:
        if not self.nodes:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]
            where = ["--head", f"--port={self.port}", f"--temp-dir={self.temp}"]
            where += ["--include-dashboard=false"]
        else:
            where = [f"--address={self.address}"]
        cmd = [RAY, "start", "--block", f"--num-cpus={cpus}", "--disable-usage-stats", *where]
        if resources:
            cmd.append(f"--resources={json.dumps(resources)}")
        log = (self.logs / f"ray-{name}.log").open("wb")
        self.nodes[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.seen[name] = {self.nodes[name].pid}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_nodes(self, count: int, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.descendants()
            status = subprocess.run(
                [RAY, "status", f"--address={self.address}"], capture_output=True, text=True
            ).stdout
            active = status.partition("Active:")[2].partition("Pending:")[0]
            if active.count(" node_") >= count:  # (not a lost node, listed in failures)
                return
            time.sleep(1.0)
        raise AssertionError(f"{count} Ray nodes not up in {timeout:.0f} s")

    def descendants(self, name: str | None = None) -> list[psutil.Process]:
        """The live processes under node ``name`` (every node's when None), remembered."""
        found = []
        for node in [name] if name else list(self.nodes):
            for pid in list(self.seen[node]):
                try:
                    proc = psutil.Process(pid)
                    tree = [proc, *proc.children(recursive=True)]
                except psutil.NoSuchProcess:
                    continue
                for p in tree:
                    self.seen[node].add(p.pid)
                found += [p for p in tree if p.status() != psutil.STATUS_ZOMBIE]
        return found

    def stop(self) -> list[int]:
        """Kill every process of every node we started; returns any still alive."""
        procs = self.descendants()
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(procs, timeout=10)
        for proc in self.nodes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        alive = []
        for pids in self.seen.values():
            for pid in pids:
                with contextlib.suppress(psutil.NoSuchProcess):
                    if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                        alive.append(pid)
        shutil.rmtree(self.temp, ignore_errors=True)
        return alive


@contextlib.contextmanager
def two_nodes(tmp_path: Path) -> Iterator[LocalCluster]:
    """A head (the syncer's resource) and a node "a" of 2 CPUs; every process stopped after."""
    c = LocalCluster(tmp_path)
    try:
        c.start("head", cpus=1, resources={"ddiloco_syncer": 1})
        c.start("a", cpus=2)
        c.wait_nodes(2)
        yield c
    finally:
        left = c.stop()
        assert not left, f"Ray processes left behind: {left}"


@pytest.fixture
def cluster(tmp_path):
    with two_nodes(tmp_path) as c:
        yield c


def on_cluster(cluster: LocalCluster, overrides: list[str]) -> RunConfig:
    """A Ray run's config on ``cluster`` (ddiloco's own sockets on loopback)."""
    ray_at = ["runtime='ray'", f"ray.address='{cluster.address}'", "ray.service_host='127.0.0.1'"]
    return load_config(None, [*overrides, *ray_at])  # (after the bases: they name a runtime)


def test_a_ray_run_survives_a_killed_and_a_frozen_learner_and_nodes_coming_and_going(
    tmp_path, cluster, monkeypatch
):
    out = tmp_path / "run"
    config = on_cluster(
        cluster,
        [
            *SMALL,
            "train.scavenged=1",
            "train.tokens=10000000",  # (the hook ends the run, 10 s after the node loss)
            "train.eval_every=200000",
            "processes.max_wall_seconds=240",
        ],
    )
    state: dict[str, Any] = {"added": None, "lost": None, "rounds": 0, "steps": 0}
    trained = {0: 0, 1: 0}  # each learner's steps in its first life

    def hook(launcher: RayLauncher, r: dict[str, Any]) -> None:
        # the kill and the freeze strike learners that train, whatever the load (a kill at a
        # fixed 20 s could hit an actor still importing torch: never placed, no first life)
        if r["kind"] == "step" and r["learner"] in trained and "crashed" not in state:
            trained[r["learner"]] += 1
            if min(trained.values()) >= 10:
                launcher.play(ChaosEvent(launcher.now(), kind="crash", learner=0, duration=1.0))
                state["crashed"] = launcher.now()
        if "crashed" in state and "froze" not in state and launcher.now() > state["crashed"] + 4:
            launcher.play(ChaosEvent(launcher.now(), kind="freeze", learner=1, duration=4.0))
            state["froze"] = True
        state["rounds"] += r["kind"] == "round"
        if state["added"] is None and state["rounds"] >= 2:
            cluster.start("b", cpus=1)  # capacity appears: a pending learner is placed
            state["added"] = time.monotonic()
        if r["kind"] == "started":
            state.setdefault("starts", []).append(r)
        starts = state.get("starts", [])
        first = {s["node"] for s in starts[:3]}  # the syncer's and learners 0-1's nodes
        on_b = [s for s in starts[3:] if s["node"] not in first]
        if on_b and r["kind"] == "step" and r["learner"] == int(on_b[0]["process"][8:]):
            state["steps"] += 1
            if state["lost"] is None and state["steps"] >= 20:  # the chaos plan's node loss
                event = ChaosEvent(at=launcher.now(), kind="node_loss", learner=r["learner"])
                launcher.play(event)  # once the learner Ray put there trains: lost with it
                state["lost"] = time.monotonic()
        if r["kind"] == "recovered" and r["learner"] == 0:  # the crashed one, back
            state["recovered"] = True
        lost_a_while = state["lost"] is not None and time.monotonic() - state["lost"] > 10.0
        if lost_a_while and "recovered" in state and "stop" not in state:  # (the others on)
            state["stop"] = True
            launcher.request_stop()

    (summary,) = train_with_hook(config, out, hook, monkeypatch)
    rs = records(out)
    events = [r for r in rs if r["kind"] not in ("step", "round", "eval")]  # (for a failure)
    assert summary["runtime"] == "ray"
    assert summary["tokens"] > 0 and summary["stopped"]
    assert state["added"] is not None and state["lost"] is not None, state
    lost = next(r for r in rs if r["kind"] == "chaos" and r["event"] == "node_loss")
    assert "skipped" not in lost and lost["node"], lost.get("skipped")  # node b's raylet killed
    cluster.nodes["b"].wait(timeout=30)  # its `ray start` went with it
    # the killed learner came back through a peer copy, on the actor Ray restarted
    assert any(r["kind"] == "recovered" and r["learner"] == 0 for r in rs), events
    restarted = [r for r in rs if r["kind"] == "started" and r["process"] == "learner-0"]
    crash = next(r for r in rs if r["kind"] == "chaos" and r["event"] == "crash")
    # (the kill waits for learners that train: one still starting was never placed, and its
    # restart was not seen as one: 1 CI run of 3 on 2026-12-02, when the kill came at 20 s)
    assert len(restarted) >= 2 and restarted[-1]["reconstructed"], (crash, restarted)
    assert len({r["pid"] for r in restarted}) == len(restarted)  # a new worker process
    # the frozen one was frozen (SIGSTOP through its node) and trained after
    freeze = next(r for r in rs if r["kind"] == "chaos" and r["event"] == "freeze")
    assert "skipped" not in freeze, freeze
    assert any(r["kind"] == "step" and r["learner"] == 1 and r["t"] > freeze["t"] + 4 for r in rs)
    # a pending learner (the scavenged slot, or the killed one's restart: Ray picks) was
    # placed on the node that joined, trained there, and its life ended with the node
    starts = [r for r in rs if r["kind"] == "started"]
    first_nodes = {r["node"] for r in starts[:3]}  # the syncer's and learners 0-1's
    on_b = [r for r in starts if r["node"] not in first_nodes]
    assert on_b, starts
    slot = int(on_b[0]["process"].split("-")[1])
    # (up in that life: after the slot's previous start; its own `started` is stamped when
    # the launcher hears where Ray put it, which can be after the learner is already up)
    before = [r["t"] for r in starts if r["process"] == on_b[0]["process"] and r is not on_b[0]]
    since = max([t for t in before if t < on_b[0]["t"]], default=0.0)
    assert any(r["kind"] == "learner_up" and r["learner"] == slot and r["t"] > since
               for r in rs), events  # fmt: skip
    assert any(r["kind"] == "step" and r["learner"] == 2 for r in rs)  # the scavenged slot too
    assert any(r["kind"] == "exited" and r["process"] == f"learner-{slot}" and r["t"] > on_b[0]["t"]
               for r in rs), events  # fmt: skip
    # no merge doubled: each (fragment, version) merged once
    merged = [(r["fragment"], r["version"]) for r in rs if r["kind"] == "round"]
    assert len(merged) == len(set(merged))
    assert (out / "summary.json").exists()
    ledger = {k: v for k, v in summary.items() if "ledger" in k or k.startswith("tokens")}
    assert summary["ledger_balanced"] and summary["ledger_errors"] == 0, ledger


def test_a_warm_spare_actor_takes_a_killed_learners_slot(tmp_path, cluster):
    cluster.start("c", cpus=1)  # room for the spare next to learners 0-1
    cluster.wait_nodes(3)
    config = on_cluster(
        cluster,
        [
            *SMALL,
            "processes.spares=1",
            "train.tokens=10000000",
            "processes.max_wall_seconds=180",
        ],
    )
    state: dict[str, Any] = {"rounds": 0, "after": 0}

    def hook(launcher: RayLauncher, r: dict[str, Any]) -> None:
        state["rounds"] += r["kind"] == "round"
        ready = state["rounds"] >= 2 and len(launcher.spares.ready) == 1
        if ready and "killed" not in state and r["kind"] == "step" and r["learner"] == 0:
            state["actor"] = launcher.actors["learner-0"]
            state["killed"] = launcher.play_crash(0, down_seconds=0.2)
        if stop_after_recovery(launcher, r, state, steps=30):
            try:  # the killed actor is not restarted (it would import torch for nothing)
                ray.get(state["actor"].where.remote(), timeout=20)
            except ray.exceptions.RayActorError as exc:
                state["gone"] = type(exc).__name__

    rs: list[dict[str, Any]] = []
    summary = RayLauncher(config, "decoupled", tmp_path / "run", rs.append, hooks=[hook]).run()
    events = [r for r in rs if r["kind"] not in ("step", "round", "eval")]  # (for a failure)
    spare = next(r for r in rs if r["kind"] == "started" and r["process"] == "spare-0")
    took = [r for r in rs if r["kind"] == "started" and r.get("spare")]
    assert len(took) == 1 and took[0]["process"] == "learner-0", events
    assert took[0]["pid"] == spare["pid"]  # the spare actor's own worker became learner 0
    assert took[0]["t"] - state["killed"] < 1.0  # no actor restart, no torch import between
    recovered = state["recovered"]
    assert recovered["step"] > 0  # it copied a live peer's state (or the syncer's fragments)
    assert any(r["kind"] == "round" and r["t"] > recovered["t"] and r["weights"].get("0")
               for r in rs)  # fmt: skip  # its answers are merged again
    assert state.get("gone") == "ActorDiedError", state
    ledger = {k: v for k, v in summary.items() if "ledger" in k or k.startswith("tokens")}
    assert summary["ledger_balanced"] and summary["ledger_errors"] == 0, ledger
    assert not [r for r in rs if r["kind"] == "exited" and r["process"].startswith("spare")]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_learner_of_two_ranks_is_a_placement_group_that_restarts_whole(
    tmp_path, cluster, parallel
):
    config = on_cluster(
        cluster,
        [
            *SMALL,
            "ray.learner_cpus=0.5",  # 2 learners x 2 ranks on node a's 2 CPUs
            "processes.ranks=2",
            f"train.parallel='{parallel}'",  # fsdp: each rank actor holds half the model
            "train.batch_size=2",
            "train.warmup_steps=20",
            "train.tokens=10000000",
            "processes.detect_seconds=5.0",
            "processes.max_wall_seconds=200",
        ],
    )
    state: dict[str, Any] = {"rounds": 0, "after": 0}

    def hook(launcher: RayLauncher, r: dict[str, Any]) -> None:
        state["rounds"] += r["kind"] == "round"
        if state["rounds"] >= 2 and "killed" not in state:
            _, actors = launcher.groups["learner-0"]
            ray.kill(actors[1], no_restart=False)  # rank 1 alone dies (Ray restarts it)
            state["killed"] = launcher.now()
        stop_after_recovery(launcher, r, state, steps=20)

    rs: list[dict[str, Any]] = []
    launcher = RayLauncher(config, "decoupled", tmp_path / "run", rs.append, hooks=[hook])
    summary = launcher.run()
    events = [r for r in rs if r["kind"] not in ("step", "round", "eval")]  # (for a failure)
    # torchrun's rule: the rank's death ended its learner's life, rank 0 included ...
    exits = [r for r in rs if r["kind"] == "exited" and r["process"] == "learner-0"]
    assert exits and " ended (" in exits[0]["reason"], events  # "learner-0.rank<r> ended"
    # ... and the whole learner came back: both ranks on new workers, copying a peer
    starts = [r for r in rs if r["kind"] == "started" and r["process"] == "learner-0"]
    assert len(starts) == 2 and all(r["ranks"] == 2 for r in starts), starts
    assert starts[1]["pid"] != starts[0]["pid"]
    assert state["recovered"]["step"] > 0, events
    if parallel == "fsdp":  # each rank actor copied the same rank of learner 1
        assert state["recovered"]["peer"] == 1 and state["recovered"]["ranks"] == 2, events
    done = launcher.learner_done
    assert sorted(done) == [0, 1], events
    for record in done.values():  # every rank trained, merges reached every rank
        assert record["ranks"] == 2 and record["ranks_in_sync"], record
    assert {r["learner"] for r in rs if r["kind"] == "step"} == {0, 1}  # rank 0 only speaks
    ledger = {k: v for k, v in summary.items() if "ledger" in k or k.startswith("tokens")}
    assert summary["ledger_balanced"] and summary["ledger_errors"] == 0, ledger


def test_a_killed_syncer_actor_restarts_from_its_store_and_the_learners_find_it(tmp_path, cluster):
    config = on_cluster(
        cluster, [*SMALL, "train.tokens=10000000", "processes.max_wall_seconds=200"]
    )
    hook, state = kill_syncer_then_stop()

    rs: list[dict[str, Any]] = []
    launcher = RayLauncher(config, "decoupled", tmp_path / "run", rs.append, hooks=[hook])
    summary = launcher.run()
    events = [r for r in rs if r["kind"] not in ("step", "round", "eval")]  # (for a failure)
    restored = state.get("restored")
    assert restored is not None, events
    for p, version in state["versions"].items():
        assert restored["versions"][p] >= version  # no acknowledged merge was lost
    starts = [r for r in rs if r["kind"] == "started" and r["process"] == "syncer"]
    assert len(starts) == 2 and starts[1]["pid"] != state["pid"], starts  # a new worker
    assert starts[1]["node"] == starts[0]["node"]  # pinned: its store is on that node's disk
    merged = [(r["fragment"], r["version"]) for r in rs if r["kind"] == "round"]
    assert len(merged) == len(set(merged))  # no merge doubled across the restart
    assert state["after"] >= 8 and summary["rounds"] >= 8, events  # learners found it again
    ledger = {k: v for k, v in summary.items() if "ledger" in k or k.startswith("tokens")}
    assert summary["ledger_balanced"] and summary["ledger_errors"] == 0, ledger


def test_link_faults_on_ray_go_through_a_proxy_actor_that_outlives_its_own_crash(tmp_path, cluster):
    """A fault proxy actor next to the syncer: wire faults are caught, a plan's link cut holds
    learner 1's traffic, and a crash of the proxy's actor mid-cut is restarted by Ray with
    what is left of the cut replayed; the learners dial the restarted proxy again."""
    cut_seconds = 14.0  # (the proxy's actor is killed 0.5 s in, and back before it ends)
    config = on_cluster(
        cluster,
        [
            *SMALL,
            "train.tokens=10000000",
            "processes.max_wall_seconds=200",
            "processes.proxy='duplicate=0.05,corrupt=0.03'",
        ],
    )
    state: dict[str, Any] = {"rounds": 0, "after": {0: 0, 1: 0}}

    def merged_from(r: dict[str, Any], m: int) -> bool:
        return r["kind"] == "round" and bool(r["weights"].get(str(m)))

    def hook(launcher: RayLauncher, r: dict[str, Any]) -> None:
        state["rounds"] += r["kind"] == "round"
        if "cut" not in state and state["rounds"] >= 3 and merged_from(r, 1):
            state["cut"] = launcher.now()
            launcher.play(ChaosEvent(state["cut"], "link_cut", 1, duration=cut_seconds))
        elif "cut" in state and "crash" not in state and launcher.now() > state["cut"] + 0.5:
            state["crash"] = launcher.now()  # a crash, not a stop we asked for: Ray restarts it
            state["pid"] = launcher.procs["proxy"].pid
            ray.kill(launcher.actors["proxy"], no_restart=False)
        if r["kind"] == "started" and r["process"] == "proxy" and "crash" in state:
            state["back"] = launcher.now()  # the restarted proxy is placed
        if "back" in state and launcher.now() > state["cut"] + cut_seconds:
            for m in (0, 1):  # both learners merged again, through the restarted proxy
                state["after"][m] += merged_from(r, m)
            if min(state["after"].values()) >= 2 and not launcher.stop_requested:
                launcher.request_stop()

    rs: list[dict[str, Any]] = []
    summary = RayLauncher(config, "decoupled", tmp_path / "run", rs.append, hooks=[hook]).run()
    events = [r for r in rs if r["kind"] not in ("step", "round", "eval")]  # (for a failure)
    start, end = state["cut"], state["cut"] + cut_seconds
    (chaos,) = [r for r in rs if r["kind"] == "chaos"]
    assert chaos["event"] == "link_cut" and "skipped" not in chaos, chaos
    # the proxy is placed as the syncer is (the node with ray.syncer_resource), both lives
    starts = {p: [r for r in rs if r["kind"] == "started" and r["process"] == p]
              for p in ("syncer", "proxy")}  # fmt: skip
    assert len(starts["proxy"]) == 2, events
    assert {r["node"] for r in starts["proxy"]} == {starts["syncer"][0]["node"]}
    assert starts["proxy"][1]["pid"] != state["pid"]  # Ray's new worker for it
    # learner 1 was cut off: detected mid-cut, not merged from then until the cut ended (the
    # restarted proxy was sent what was left of it), merged again after
    detected = [r["t"] for r in rs if r["kind"] == "detected" and r["learner"] == 1]
    assert detected and start < detected[0] < end, events
    assert not [r for r in rs if merged_from(r, 1) and detected[0] <= r["t"] < end]
    assert min(state["after"].values()) >= 2, state  # both found the restarted proxy
    # the wire faults were played and caught (damaged frames refused, duplicates as replays)
    refused = Counter(summary["refused"]) + Counter(summary["refused_by_learners"])
    assert refused["replay"] > 0 and refused["checksum"] > 0, refused
    assert summary["proxy"].get("messages", 0) > 0  # the restarted proxy's counts came back
    if state["back"] + 1.0 < end:  # up before the cut's end: it was sent what was left of it
        assert summary["proxy"].get("link_cut") == 1, (summary["proxy"], state, end)
    merged = [(r["fragment"], r["version"]) for r in rs if r["kind"] == "round"]
    assert len(merged) == len(set(merged))
    ledger = {k: v for k, v in summary.items() if "ledger" in k or k.startswith("tokens")}
    ledger["contradictions"] = summary.get("ledger_contradictions")
    assert summary["ledger_balanced"] and summary["ledger_errors"] == 0, ledger


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_an_own_loop_runs_as_ray_actors_and_a_crashed_one_copies_its_peer(tmp_path, monkeypatch):
    """``train.entry`` on Ray: examples/own_loop.py's loop in every learner actor (the
    nodes started with the examples on their PYTHONPATH, as a user's cluster has their
    code), learner 1 crashed mid-run: its actor restarts and copies learner 0."""
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the launcher's pre-flight imports it
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLES), *sys.path]))
    sets = [
        "model='own_loop:build_model'",
        "train.entry='own_loop:main'",
        "train.evaluate='own_loop:evaluate'",
        "methods=['decoupled']",
        "ray.learner_cpus=0.5",
        "train.learners=2",
        "train.batch_size=8",
        "train.seq_len=64",
        "train.tokens=10000000",
        "train.eval_every=1000000",
        "sync.fragments=3",
        "sync.sync_every=6",
        "data.eval_batches=2",
        "processes.detect_seconds=5.0",
        "processes.max_wall_seconds=200",
    ]
    with two_nodes(tmp_path) as c:
        hook, state = kill_then_stop(1, down=0.5, steps=40, rounds=3)
        rs: list[dict[str, Any]] = []
        config = on_cluster(c, sets)
        launcher = RayLauncher(config, "decoupled", tmp_path / "run", rs.append, hooks=[hook])
        summary = launcher.run()
        sys.modules.pop("own_loop", None)
    events = [r for r in rs if r["kind"] not in ("step", "round")]
    assert state["recovered"]["peer"] == 0 and state["recovered"]["bytes"] > 0, events
    assert summary["ledger_balanced"] and summary["ledger_errors"] == 0
    evals = [r["loss"] for r in rs if r["kind"] == "eval"]
    assert evals[-1] < evals[0] - 1.0, evals
