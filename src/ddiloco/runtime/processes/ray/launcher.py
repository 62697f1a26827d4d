"""``ddiloco train --runtime ray``: the processes runtime's syncer and learners as Ray actors.

A :class:`RayLauncher` is the local :class:`~ddiloco.runtime.processes.launcher.fragments.Launcher`
with its children placed on a Ray cluster instead of spawned on this host: the commands,
the events relayed into the run's metrics, the restart policy, the chaos plan, the stop and
the summary are the launcher's own; only how a child starts (:meth:`RayLauncher._spawn`) and
how a signal reaches it (:meth:`RayLauncher.signal`) differ. Ray Core actors, not Ray Train
(which restarts the whole worker group on a failure): every learner is an actor of its own
with ``max_restarts=-1``, so a learner's death costs only that learner.

- The syncer actor is pinned to a node carrying ``ray.syncer_resource`` (its store lives on
  that node's disk) and named, so learners find its address by name (``--syncer ray:NAME``).
- Each learner actor asks for ``ray.learner_cpus`` CPUs and, on CUDA, one GPU per rank;
  Ray gives it its own devices, so two learners never share one.
- Chaos: ``crash`` kills the actor (Ray restarts its process, and the restarted learner
  copies a peer), ``freeze``/``slow`` SIGSTOP/SIGCONT its worker process (through a task
  pinned to its node), ``leave`` is the service's clean stop, ``join`` places a slot. A
  scavenged slot (``train.scavenged``) the plan does not start is asked for at once and
  placed when a node with capacity joins; a node that leaves takes its actors with it, and
  Ray places them again where there is room.
- Warm spares (``processes.spares``) are actors too: each has imported torch and read the
  data, and takes a dead learner's slot in about a second (its order reaches the spare's
  stdin through :meth:`~.actor.ServiceHost.order`); the dead learner's actor is then killed
  for good rather than restarted.
- A learner of several ranks (``processes.ranks`` > 1) is one placement group of rank
  actors running torch.distributed inside, only rank 0 talking to the syncer (:mod:`.ranks`).
- ``node_loss`` takes down the learner's node (its raylet, and with it every worker there);
  the learner is placed again where there is room. Not on the head, the syncer's or the
  driver's node (recorded as skipped: that would end the run).
- Link faults (``link_cut``/``link_slow``) and wire faults (``processes.proxy``) are played
  by the fault proxy, as on one host: it is an actor placed as the syncer is (on the node
  carrying ``ray.syncer_resource``), found by learners by its name; its link commands reach
  its stdin through :meth:`~.actor.ServiceHost.order`. It listens on the port after
  ``processes.bind``'s (a free one when that names none).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from ddiloco.chaos.plan import ChaosEvent, chaos_record
from ddiloco.runtime.processes.launcher.devices import gpus_each
from ddiloco.runtime.processes.launcher.fragments import SYNCER, Launcher, free_port
from ddiloco.runtime.processes.launcher.link_faults import PROXY, faults_of
from ddiloco.runtime.processes.ray.actor import (
    NODE,
    RAY_ACTOR,
    SIGNALS,
    ServiceActor,
    lose_node,
    send_signal,
)
from ddiloco.runtime.processes.ray.child import DIED, ActorChild, relay
from ddiloco.runtime.processes.ray.cluster import LOCAL_IP, Cluster
from ddiloco.runtime.processes.ray.ranks import RankLives, rank_group
from ddiloco.runtime.processes.transport.sockets import SECRET_ENV, parse_address

SIGNAL_SECONDS = 10.0  # a signal's task or a clean stop's call, at most


class RayLauncher(Launcher):
    """A fragment method's run on a Ray cluster (see the module)."""

    RUNTIME = "ray"

    def connect(self) -> None:
        config = self.config
        train, processes = config.train, config.processes
        actors = (train.learners + train.scavenged) * processes.ranks + processes.spares
        self.cluster = Cluster.join(config, actors)
        _, port = parse_address(config.processes.bind, "processes.bind")
        # the syncer binds its own node's address; a port the driver found free is a guess
        # on another host: a multi-host cluster names one in processes.bind
        self.host = config.ray.service_host or (LOCAL_IP if self.cluster.local else NODE)
        self.reserved = []  # (fragments.free_port: kept from other processes until shutdown)
        self.address = f"{self.host}:{port or free_port(LOCAL_IP, self.reserved)}"
        syncer = f"{RAY_ACTOR}{self.actor_name(SYNCER)}"
        self.learner_address, self.links = syncer, None
        if faults_of(config) is not None:  # learners dial the proxy, it dials the syncer
            listen = f"{self.host}:{port + 1 if port else free_port(LOCAL_IP, self.reserved)}"
            self.learner_address = f"{RAY_ACTOR}{self.actor_name(PROXY)}"
            self.links = self.link_faults(listen, syncer)
        self.actors: dict[str, Any] = {}
        self.groups: dict[str, tuple[Any, list[Any]]] = {}  # a ranked slot's group, actors
        self._config_text: str | None = None

    def learner_gpus(self) -> dict[int, str]:
        return {}  # Ray hands each learner actor its own (num_gpus)

    def actor_name(self, name: str) -> str:
        return f"{self.run_id}-{name}"

    # -- children ---------------------------------------------------------------------------
    def ranked(self, cmd: list[str]) -> list[str]:
        return cmd  # a learner's ranks are actors of their own (:mod:`.ranks`), no torchrun

    def _launch(
        self,
        name: str,
        args: list[str],
        control: bool,
        env: dict[str, str] | None,
        old: Any,
    ) -> None:
        """The new life of ``name`` on its actor (or its rank actors), read by :func:`relay`."""
        if self._config_text is None:
            self._config_text = self.config_path.read_text(encoding="utf-8")
        if name.startswith("learner-") and self.host != NODE:
            args = [*args, "--peer-host", self.host]
        child_env = {SECRET_ENV: self.env[SECRET_ENV], "PYTHONUNBUFFERED": "1", **(env or {})}
        text, namespace = self._config_text, self.config.ray.namespace
        child: ActorChild | RankLives
        if name.startswith("learner-") and self.config.processes.ranks > 1:
            actors = self._rank_actors(name, old if isinstance(old, RankLives) else None)
            pids = old.pids if isinstance(old, RankLives) else [-1] * len(actors)
            child = RankLives(
                name,
                actors,
                lambda r, rank_env: actors[r].run.remote(
                    args, text, {**child_env, **rank_env}, namespace
                ),
                avoid_pids=pids,
            )
        else:
            actor = self.actors.get(name)
            if actor is None or (isinstance(old, ActorChild) and old.gone):  # (dead for good)
                actor = self.actors[name] = self._new_actor(name)
            child = ActorChild(
                name,
                actor,
                lambda: actor.run.remote(args, text, child_env, namespace),
                # a life that exited cleanly leaves its process to the next (else replaced)
                avoid_pid=old.pid if isinstance(old, ActorChild) and old.returncode else -1,
                stdin=control,  # a spare's: its slot comes as one line
            )
        self.procs[name] = child  # type: ignore[assignment]  # a Popen to the supervisor
        self.policy.started(name)
        scavenged = self._slot(name) >= self.config.train.learners
        reader = threading.Thread(
            target=relay,
            args=(child, self.events, self.log_files[name], self.config.ray.place_seconds),
            kwargs={"quiet_wait": scavenged, "retire": self._retire},
            daemon=True,
        )
        self.readers[name] = reader
        reader.start()

    def _retire(self, child: ActorChild | RankLives) -> None:
        """A life ended in its actors: nothing of it may go on running there (a crashed
        learner's threads would keep talking to the syncer, a crashed syncer's would hold its
        port, a rank's process group cannot be set up twice in one process), so the
        processes of a life that failed, or of a learner's ranks, are replaced: Ray restarts
        those actors. Not once the run is over (its actors are killed for good)."""
        if self.finished.is_set():
            return
        for life in child.lives():
            if life.gone or life.returncode == DIED:  # (dead already)
                continue
            if life.returncode != 0 or isinstance(child, RankLives):
                ray.kill(life.actor, no_restart=False)

    def _new_actor(self, name: str, strategy: Any = None) -> Any:
        ray_config = self.config.ray
        options: dict[str, Any] = {
            "name": self.actor_name(name),
            "namespace": ray_config.namespace,
            "max_restarts": -1,
            "max_task_retries": 0,
        }
        if name in (SYNCER, PROXY):  # the proxy is placed as the syncer is: on its node
            options["num_cpus"] = ray_config.syncer_cpus if name == SYNCER else 0
            if ray_config.syncer_resource:
                options["resources"] = {ray_config.syncer_resource: 0.01}
        else:
            ranks = self.config.processes.ranks if strategy is not None else 1
            options["num_cpus"] = ray_config.learner_cpus
            options["num_gpus"] = gpus_each(self.config) / ranks
        if strategy is not None:
            options["scheduling_strategy"] = strategy
        return ServiceActor.options(**options).remote(name, warm=name != PROXY)

    def _rank_actors(self, name: str, old: RankLives | None) -> list[Any]:
        """Slot ``name``'s rank actors, each in its bundle of the slot's placement group
        (made once: Ray restarts them, and places the group again if its node dies; an
        actor the last life found dead for good is replaced in its bundle)."""
        ranks = self.config.processes.ranks
        if name not in self.groups:
            bundle = {"CPU": self.config.ray.learner_cpus}
            gpus = gpus_each(self.config) / ranks
            if gpus:
                bundle["GPU"] = gpus
            self.groups[name] = (rank_group(ranks, bundle), [None] * ranks)
        group, actors = self.groups[name]
        for r in range(ranks):
            if actors[r] is None or (old is not None and old.ranks[r].gone):
                in_bundle = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=r)
                actors[r] = self._new_actor(f"{name}.rank{r}", in_bundle)
        return actors

    @staticmethod
    def _slot(name: str) -> int:
        return int(name.split("-")[1]) if name.startswith("learner-") else -1

    def rename(self, old: str, new: str) -> None:
        """A spare's actor takes the slot ``new``; the slot's last actor (Ray may be
        restarting it) is killed for good: the pool starts a new spare later."""
        super().rename(old, new)
        gone = self.actors.pop(new, None)
        self.actors[new] = self.actors.pop(old)
        if gone is not None:
            ray.kill(gone, no_restart=True)

    def handle(self, name: str, record: dict[str, Any]) -> None:
        if record.get("kind") == "started":  # the reader learnt where the actor was placed
            self.emit({**record, "t": self.now(), "run": self.run_id})
            return
        super().handle(name, record)

    def signal(self, name: str, sig: int) -> bool:
        """``sig`` to one of our actors (every rank's, for a learner of several): SIGKILL
        kills it (Ray restarts it, but not at the end of the run), SIGTERM is its service's
        clean stop, SIGSTOP/SIGCONT reach its worker process through a task pinned to its
        node."""
        child = self.procs.get(name)
        if not isinstance(child, ActorChild | RankLives):
            return super().signal(name, sig)
        if child.poll() is not None:
            return False
        lives = child.lives()
        if sig in (signal.SIGKILL, signal.SIGTERM):  # an exit we asked for
            self.expected_exit.add(name)
        if sig == signal.SIGTERM and child.where is None:  # never placed: nothing to stop
            sig = signal.SIGKILL
        if sig == signal.SIGKILL:
            # a ready spare will take a learner's slot: no restart of its actor to pay for
            spared = name.startswith("learner-") and bool(self.spares.ready)
            for life in lives:
                ray.kill(life.actor, no_restart=self.finished.is_set() or spared)
            if spared:
                self.actors.pop(name, None)  # (a new one, if the spare is gone by then)
            child.end(DIED, "killed")  # (Ray says so a second later: the next life may start)
            return True
        if sig == signal.SIGTERM:
            heard = 0
            for life in lives:
                with contextlib.suppress(ray.exceptions.RayError):
                    heard += ray.get(life.actor.terminate.remote(), timeout=SIGNAL_SECONDS)
            if not heard:  # not serving yet (still importing): a stop is then a kill
                for life in lives:
                    ray.kill(life.actor, no_restart=self.finished.is_set())
                child.end(DIED, "stopped before it served")
            return True
        if sig not in SIGNALS or any(life.where is None for life in lives):
            return False
        tasks = [
            send_signal.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(life.where["node"], soft=False)
            ).remote(life.pid, sig)
            for life in lives
            if life.where is not None
        ]
        try:
            return all(ray.get(tasks, timeout=SIGNAL_SECONDS))
        except ray.exceptions.RayError:
            return False

    def ask_to_stop(self, name: str) -> None:
        child = self.procs.get(name)
        if isinstance(child, ActorChild | RankLives):
            for life in child.lives():
                life.actor.terminate.remote()  # (its answer is not awaited)

    # -- chaos ------------------------------------------------------------------------------
    def play(self, event: ChaosEvent) -> None:
        if event.kind == "node_loss":
            self.emit({**chaos_record(event, self.now()), **self.lose_node(event.learner)})
            return
        super().play(event)

    def lose_node(self, m: int) -> dict[str, Any]:
        """Chaos ``node_loss``: the node learner ``m`` runs on goes, raylet, workers and all
        (:func:`~.actor.lose_this_node`). Not a stop the launcher asked for: the learners on
        it die as on a real node failure, and the restart policy and Ray place them again
        where there is room (``duration`` is not played: no node comes back by itself).
        Refused (a ``skipped`` reason) on the head node, the syncer's, the fault proxy's and
        this driver's: losing one of those would end the run, not test it. Returns what the
        record adds."""
        name = f"learner-{m}"
        child = self.procs.get(name)
        if not isinstance(child, ActorChild | RankLives) or child.poll() is not None:
            return {"skipped": f"{name} is not running"}
        placed = [life.where for life in child.lives() if life.where is not None]
        if not placed:
            return {"skipped": f"{name} is not placed on a node yet"}
        node = str(placed[0]["node"])
        kept = {ray.get_runtime_context().get_node_id(): "this driver's"}
        kept |= {
            n["NodeID"]: "the head"
            for n in ray.nodes()
            if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {})
        }
        for service in (PROXY, SYNCER):
            host = self.procs.get(service)
            if isinstance(host, ActorChild) and host.where is not None:
                kept[str(host.where["node"])] = f"the {service}'s"
        if node in kept:
            why = f"{name} runs on {kept[node]} node ({node[:12]}): losing it would end the run"
            return {"skipped": why}
        try:
            raylet = ray.get(
                lose_node.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                ).remote(),
                timeout=SIGNAL_SECONDS,
            )
        except (ray.exceptions.NodeDiedError, ray.exceptions.WorkerCrashedError):
            return {"node": node}  # (the node went before the task's answer got out)
        except ray.exceptions.RayError as exc:
            return {"skipped": f"node {node[:12]} did not take the node-loss task: {exc}"}
        if raylet is None:
            return {"skipped": f"no raylet found on node {node[:12]} (not Linux?)"}
        return {"node": node, "raylet": raylet}

    def run(self) -> dict[str, Any]:
        try:
            return super().run()
        finally:
            self.cluster.close()

    def shutdown(self) -> None:
        super().shutdown()
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        for group, actors in self.groups.values():
            for actor in actors:
                ray.kill(actor, no_restart=True)
            remove_placement_group(group)
