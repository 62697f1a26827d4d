"""KubeRay: a ``RayCluster`` whose node groups fit the run, and how to submit it.

The cluster has a head group (Ray's control plane and the job's driver, no tasks), one
CPU worker carrying the custom resource the Ray runtime pins the syncer to
(``ray.syncer_resource``; none when that is ""), so the syncer has a node of its own, and a
worker group of one pod per learner with its GPUs. The run itself is ``ddiloco train
--runtime ray`` submitted as a Ray job (README.md in the output); that launcher makes the run
secret itself, so no Secret is mounted here.
"""

from __future__ import annotations

import json
from typing import Any

from ddiloco.config import RunConfig
from ddiloco.deploy.common import (
    CONFIG_FILE,
    DeployOptions,
    Plan,
    yaml_documents,
)
from ddiloco.deploy.kubernetes import CONFIG_DIR, MOUNTS, config_map, labels, prepare, volumes

HEAD_PORTS = [
    {"name": "gcs", "containerPort": 6379},
    {"name": "dashboard", "containerPort": 8265},
    {"name": "client", "containerPort": 10001},
]


def generate(config: RunConfig, config_text: str, options: DeployOptions) -> dict[str, str]:
    """``configmap.yaml``, ``raycluster.yaml`` and the README."""
    name, p = prepare(
        config,
        options,
        needs="kuberay needs a Ray image with ddiloco",
        one_node="a Ray learner is one actor on one node (use slurm for several nodes)",
    )
    cluster = ray_cluster(name, config, options, p)
    return {
        "configmap.yaml": yaml_documents(config_map(name, options, config_text)),
        "raycluster.yaml": yaml_documents(cluster),
        "README.md": readme(name, config, options, p),
    }


def _pod(options: DeployOptions, name: str, meta: dict[str, str], extra: dict[str, Any]) -> Any:
    box = {"name": name, "image": options.image, "volumeMounts": [dict(MOUNTS[0])], **extra}
    spec = {"containers": [box], "volumes": volumes(meta["app.kubernetes.io/instance"])[:1]}
    return {"metadata": {"labels": meta}, "spec": spec}


def ray_cluster(name: str, config: RunConfig, options: DeployOptions, p: Plan) -> dict[str, Any]:
    head = {
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},  # the driver only
        "template": _pod(options, "ray-head", labels(name, "head"), {"ports": HEAD_PORTS}),
    }
    learner_box: dict[str, Any] = {"ports": [{"name": "peer", "containerPort": p.peer_port}]}
    if p.gpus:
        learner_box["resources"] = {"limits": {"nvidia.com/gpu": str(p.gpus)}}
    groups = []
    resource = config.ray.syncer_resource
    if resource:
        syncer_box = {
            "ports": [{"name": "syncer", "containerPort": p.port}],
            "resources": {"requests": {"cpu": str(options.syncer_cpus)}},
        }
        groups.append(
            {
                "groupName": "syncer",
                "replicas": 1,
                "minReplicas": 1,
                "maxReplicas": 1,
                # KubeRay hands this to `ray start --resources`: JSON, quoted once more
                "rayStartParams": {"resources": json.dumps(json.dumps({resource: 1}))},
                "template": _pod(options, "ray-worker", labels(name, "syncer"), syncer_box),
            }
        )
    groups.append(
        {
            "groupName": "learners",
            "replicas": p.learners,
            "minReplicas": p.learners,
            "maxReplicas": p.learners,
            "rayStartParams": {},
            "template": _pod(options, "ray-worker", labels(name, "learner"), learner_box),
        }
    )
    spec: dict[str, Any] = {"headGroupSpec": head, "workerGroupSpecs": groups}
    if options.ray_version:
        spec = {"rayVersion": options.ray_version, **spec}
    meta = {"name": name, "namespace": options.namespace, "labels": labels(name, "cluster")}
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": meta, "spec": spec}


def readme(name: str, config: RunConfig, options: DeployOptions, p: Plan) -> str:
    ns, resource = options.namespace, config.ray.syncer_resource
    gpus = f", {p.gpus} GPU(s) each" if p.gpus else ""
    syncer = (
        f"worker group `syncer` (1 pod carrying the custom resource `{resource}`, where the "
        f"syncer runs, port {p.port}) and "
        if resource
        else "no syncer group (`ray.syncer_resource` is empty: the syncer goes anywhere) and "
    )
    return f"""\
# Run `{options.run_id}` on KubeRay

Written by `ddiloco deploy kuberay` for a cluster with the KubeRay operator: image
`{options.image}` (Ray and ddiloco installed), namespace `{ns}`. `raycluster.yaml` is the
RayCluster `{name}`: a head (no tasks: the job's driver), {syncer}worker group `learners`
({p.learners} pods{gpus}, peer port {p.peer_port}). The config is mounted at
`{CONFIG_DIR}/{CONFIG_FILE}` in every pod (ConfigMap `{name}-config`). Run from this
directory:

```bash
kubectl -n {ns} apply -f configmap.yaml -f raycluster.yaml
kubectl -n {ns} get raycluster {name}; kubectl -n {ns} get pods -l ray.io/cluster={name} -w
kubectl -n {ns} port-forward svc/{name}-head-svc 8265:8265 &
ray job submit --address http://127.0.0.1:8265 --submission-id {name} -- \\
    ddiloco train --runtime ray --config {CONFIG_DIR}/{CONFIG_FILE}
ray job logs --address http://127.0.0.1:8265 --follow {name}
ray job stop --address http://127.0.0.1:8265 {name}     # stop the run
kubectl -n {ns} delete -f raycluster.yaml -f configmap.yaml
```

`ddiloco train --runtime ray` (the Ray runtime) joins the cluster the job runs in, makes the
run secret, pins the syncer to the node with `{resource or "(any)"}` and starts one learner
actor per learner. The syncer's store is on its pod's disk: for a syncer that survives its
pod, mount a PersistentVolumeClaim in the `syncer` group's template.
"""
