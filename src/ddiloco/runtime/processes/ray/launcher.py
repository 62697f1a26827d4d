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
- Not yet: link faults and wire faults (``processes.proxy``), ``processes.ranks`` > 1, warm
  spares. A plan's link faults are recorded as skipped.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ddiloco.chaos.plan import ChaosEvent, chaos_record
from ddiloco.config import RunConfig
from ddiloco.errors import ConfigError
from ddiloco.runtime.processes.launcher.devices import gpus_each
from ddiloco.runtime.processes.launcher.fragments import SYNCER, Launcher, free_port
from ddiloco.runtime.processes.launcher.link_faults import LINK_KINDS
from ddiloco.runtime.processes.ray.actor import NODE, RAY_SYNCER, SIGNALS, ServiceActor, send_signal
from ddiloco.runtime.processes.ray.child import DIED, ActorChild, relay
from ddiloco.runtime.processes.ray.cluster import LOCAL_IP, Cluster
from ddiloco.runtime.processes.transport.sockets import SECRET_ENV, parse_address

NOT_ON_RAY = "not played by the Ray runtime yet (its links do not cross a fault proxy)"
SIGNAL_SECONDS = 10.0  # a signal's task or a clean stop's call, at most


class RayLauncher(Launcher):
    """A fragment method's run on a Ray cluster (see the module)."""

    RUNTIME = "ray"

    @staticmethod
    def refuse(config: RunConfig, method: str) -> None:
        Launcher.refuse(config, method)
        if config.processes.ranks > 1:
            why = "a learner of several ranks (a placement group of rank actors) is not built yet"
            raise ConfigError("processes.ranks", config.processes.ranks, why)
        if config.processes.proxy:
            why = "the fault-injecting proxy is not placed on Ray yet: run --runtime processes"
            raise ConfigError("processes.proxy", config.processes.proxy, why)

    def connect(self) -> None:
        config = self.config
        self.cluster = Cluster.join(config, self.config.train.learners + config.train.scavenged)
        _, port = parse_address(config.processes.bind, "processes.bind")
        # the syncer binds its own node's address; a port the driver found free is a guess
        # on another host: a multi-host cluster names one in processes.bind
        self.host = config.ray.service_host or (LOCAL_IP if self.cluster.local else NODE)
        self.address = f"{self.host}:{port or free_port(LOCAL_IP)}"
        self.learner_address = f"{RAY_SYNCER}{self.actor_name(SYNCER)}"
        self.links = None
        self.actors: dict[str, Any] = {}
        self._config_text: str | None = None

    def prepare(self) -> None:
        super().prepare()
        self.spares.count = 0  # a restarted actor is warm already (it imports when built)

    def learner_gpus(self) -> dict[int, str]:
        return {}  # Ray hands each learner actor its own (num_gpus)

    def actor_name(self, name: str) -> str:
        return f"{self.run_id}-{name}"

    # -- children ---------------------------------------------------------------------------
    def _spawn(
        self,
        name: str,
        args: list[str],
        control: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        old = self.procs.get(name)
        if old is not None and old.poll() is None:
            return
        self.expected_exit.discard(name)
        actor = self.actors.get(name)
        if actor is None:
            actor = self.actors[name] = self._new_actor(name)
        if self._config_text is None:
            self._config_text = self.config_path.read_text(encoding="utf-8")
        if name.startswith("learner-") and self.host != NODE:
            args = [*args, "--peer-host", self.host]
        child_env = {SECRET_ENV: self.env[SECRET_ENV], "PYTHONUNBUFFERED": "1", **(env or {})}
        text, namespace = self._config_text, self.config.ray.namespace
        child = ActorChild(
            name,
            actor,
            lambda: actor.run.remote(args, text, child_env, namespace),
            avoid_pid=old.pid if isinstance(old, ActorChild) else -1,
        )
        self.procs[name] = child  # type: ignore[assignment]  # a Popen to the supervisor
        self.policy.started(name)
        scavenged = self._slot(name) >= self.config.train.learners
        reader = threading.Thread(
            target=relay,
            args=(child, self.events, self.logs / f"{name}.log", self.config.ray.place_seconds),
            kwargs={"quiet_wait": scavenged},
            daemon=True,
        )
        self.readers[name] = reader
        reader.start()

    def _new_actor(self, name: str) -> Any:
        ray_config = self.config.ray
        options: dict[str, Any] = {
            "name": self.actor_name(name),
            "namespace": ray_config.namespace,
            "max_restarts": -1,
            "max_task_retries": 0,
        }
        if name == SYNCER:
            options["num_cpus"] = ray_config.syncer_cpus
            if ray_config.syncer_resource:
                options["resources"] = {ray_config.syncer_resource: 0.01}
        else:
            options["num_cpus"] = ray_config.learner_cpus
            options["num_gpus"] = gpus_each(self.config)
        return ServiceActor.options(**options).remote(name)

    @staticmethod
    def _slot(name: str) -> int:
        return int(name.split("-")[1]) if name.startswith("learner-") else -1

    def handle(self, name: str, record: dict[str, Any]) -> None:
        if record.get("kind") == "started":  # the reader learnt where the actor was placed
            self.emit({**record, "t": self.now(), "run": self.run_id})
            return
        super().handle(name, record)

    def signal(self, name: str, sig: int) -> bool:
        """``sig`` to one of our actors: SIGKILL kills it (Ray restarts it, but not at the
        end of the run), SIGTERM is its service's clean stop, SIGSTOP/SIGCONT reach its
        worker process through a task pinned to its node."""
        child = self.procs.get(name)
        if not isinstance(child, ActorChild):
            return super().signal(name, sig)
        if child.poll() is not None:
            return False
        if sig in (signal.SIGKILL, signal.SIGTERM):  # an exit we asked for
            self.expected_exit.add(name)
        if sig == signal.SIGTERM and child.where is None:  # never placed: nothing to stop
            sig = signal.SIGKILL
        if sig == signal.SIGKILL:
            ray.kill(child.actor, no_restart=self.finished.is_set())
            child.end(DIED, "killed")  # (Ray says so a second later: the next life may start)
            return True
        if sig == signal.SIGTERM:
            try:
                heard = ray.get(child.actor.terminate.remote(), timeout=SIGNAL_SECONDS)
            except ray.exceptions.RayError:
                heard = 0
            if not heard:  # not serving yet (still importing): a stop is then a kill
                ray.kill(child.actor, no_restart=self.finished.is_set())
                child.end(DIED, "stopped before it served")
            return True
        if sig not in SIGNALS or child.where is None:
            return False
        on_its_node = NodeAffinitySchedulingStrategy(child.where["node"], soft=False)
        task = send_signal.options(scheduling_strategy=on_its_node).remote(child.pid, sig)
        try:
            return bool(ray.get(task, timeout=SIGNAL_SECONDS))
        except ray.exceptions.RayError:
            return False

    # -- chaos ------------------------------------------------------------------------------
    def play(self, event: ChaosEvent) -> None:
        if event.kind in LINK_KINDS:
            self.emit({**chaos_record(event, self.now()), "skipped": NOT_ON_RAY})
            return
        super().play(event)

    def run(self) -> dict[str, Any]:
        try:
            return super().run()
        finally:
            self.cluster.close()

    def shutdown(self) -> None:
        super().shutdown()
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
