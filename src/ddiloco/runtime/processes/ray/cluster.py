"""The Ray cluster a run's actors go to: an existing one (``ray.address`` or
``$RAY_ADDRESS``), or a local one started for this run and stopped with it.

Joining checks what the run needs before any actor is asked for, so a cluster that cannot
host the run says why at once instead of leaving actors pending: a node carrying
``ray.syncer_resource``. GPUs are only warned about (an autoscaling cluster adds nodes).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from ddiloco.config import RunConfig
from ddiloco.errors import ConfigError
from ddiloco.runtime.processes.launcher.devices import gpus_each

LOCAL_IP = "127.0.0.1"  # a local cluster listens on loopback only


def ray_module() -> Any:
    """Ray, or a ConfigError saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        why = "Ray is not installed: pip install 'ddiloco[ray]'"
        raise ConfigError("runtime", "ray", why) from exc
    return ray


@dataclass
class Cluster:
    """This driver's connection to the cluster (``local``: started by us)."""

    address: str
    local: bool

    @classmethod
    def join(cls, config: RunConfig, actors: int) -> Cluster:
        """Join ``ray.address`` (or ``$RAY_ADDRESS``), else start a local cluster with room for
        the syncer and ``actors`` learner-sized actors (ranks and spares included)."""
        ray = ray_module()
        rc = config.ray
        address = rc.address or os.environ.get("RAY_ADDRESS", "")
        common = {"namespace": rc.namespace, "log_to_driver": False, "logging_level": "WARNING"}
        if ray.is_initialized():
            ray.shutdown()
        if address:
            try:
                ray.init(address=address, **common)
            except Exception as exc:  # ConnectionError, or Ray's own
                raise ConfigError("ray.address", address, f"cannot join: {exc}") from exc
            cluster = cls(address, local=False)
            cluster.check(config)
            return cluster
        resources = {rc.syncer_resource: 1.0} if rc.syncer_resource else {}
        cpus = rc.syncer_cpus + rc.learner_cpus * actors  # a local cluster fits the run
        ray.init(
            num_cpus=max(1, int(cpus + 0.999)),
            resources=resources,
            include_dashboard=False,
            _node_ip_address=LOCAL_IP,
            **common,
        )
        return cls("local", local=True)

    def check(self, config: RunConfig) -> None:
        """Refuse a cluster with no node for the syncer; warn of too few GPUs."""
        import ray

        rc = config.ray
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if rc.syncer_resource and not any(
            n.get("Resources", {}).get(rc.syncer_resource, 0) > 0 for n in nodes
        ):
            why = (
                f"no live node of the cluster at {self.address} carries the resource "
                f"{rc.syncer_resource!r} the syncer is pinned to: start that node with "
                f"ray start --resources '{{\"{rc.syncer_resource}\": 1}}', or set "
                'ray.syncer_resource = "" (any node)'
            )
            raise ConfigError("ray.syncer_resource", rc.syncer_resource, why)
        each = gpus_each(config)
        have = sum(n.get("Resources", {}).get("GPU", 0) for n in nodes)
        if each and have < each * config.train.learners:
            print(
                f"ddiloco: warning: {config.train.learners} learners x {each} GPU need "
                f"{each * config.train.learners} GPUs; the cluster has {have:g} now (they wait "
                "for more nodes)",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        """Leave the cluster (a local one stops with it)."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
