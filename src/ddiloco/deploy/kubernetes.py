"""Kubernetes: the syncer and the learners as two StatefulSets, the config as a ConfigMap.

StatefulSets because both need a stable identity: the syncer its volume (``--store`` on a
claim of its own, so a rescheduled syncer resumes), every learner its slot (the pod ordinal
is the learner id, read from the pod name in the container's command). Learners start in
parallel and dial the syncer's Service; peers dial each other's pod IP (the downward API)
on the fixed ``processes.peer_port``.

Restarts: a container the kubelet restarts finds the marker its previous life left in the
pod's emptyDir and starts with ``--join`` (a healthy peer's state, else the syncer's global
fragments: ``LearnerProcess.recover``), never at step 0. A pod that is rescheduled gets a
new emptyDir and starts fresh, and a fresh start welcomed into a run already a sync period
ahead joins all the same (``LearnerProcess.late``). Exit 0 (the run is over) and 78 (a fault
a restart cannot fix) leave the container idle rather than exiting, because a StatefulSet's
pods always restart; any other exit is restarted.
"""

from __future__ import annotations

from typing import Any

from ddiloco.config import RunConfig
from ddiloco.deploy.common import (
    BASH_CHILD,
    CONFIG_FILE,
    SECRET_FILE,
    DeployOptions,
    Plan,
    Raw,
    dns_name,
    learner_args,
    plan,
    syncer_args,
    torchrun,
    words,
    yaml_documents,
)
from ddiloco.errors import require

CONFIG_DIR = "/etc/ddiloco/config"
SECRET_DIR = "/etc/ddiloco/secret"
STORE_DIR = "/var/lib/ddiloco/store"
STATE_DIR = "/var/lib/ddiloco/state"  # a learner's emptyDir: the marker, local checkpoints
STARTED = f"{STATE_DIR}/started"


def generate(config: RunConfig, config_text: str, options: DeployOptions) -> dict[str, str]:
    """``configmap.yaml``, ``syncer.yaml``, ``learners.yaml`` and the README."""
    name, p = prepare(
        config,
        options,
        needs="kubernetes needs a container image",
        one_node="a Kubernetes learner is one pod (use slurm or kuberay for several nodes)",
    )
    return {
        "configmap.yaml": yaml_documents(config_map(name, options, config_text)),
        "syncer.yaml": yaml_documents(*syncer_objects(name, options, p)),
        "learners.yaml": yaml_documents(*learner_objects(name, options, p)),
        "README.md": readme(name, options, p),
    }


def labels(name: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "ddiloco",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
    }


def prepare(
    config: RunConfig, options: DeployOptions, needs: str, one_node: str
) -> tuple[str, Plan]:
    """Where both Kubernetes targets start (pods here, a RayCluster in kuberay): the image
    they ``needs``, checked; the plan, a learner on one node (``one_node``: why); the name."""
    require(bool(options.image), "--image", options.image, needs)
    p = plan(config, options, one_node=one_node)
    return dns_name(options.run_id), p


def config_map(name: str, options: DeployOptions, config_text: str) -> dict[str, Any]:
    meta = {
        "name": f"{name}-config",
        "namespace": options.namespace,
        "labels": labels(name, "config"),
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {CONFIG_FILE: config_text},
    }


def volumes(name: str) -> list[dict[str, Any]]:
    """The config (a ConfigMap) and the secret (a Secret, a file only its owner reads)."""
    return [
        {"name": "config", "configMap": {"name": f"{name}-config"}},
        {"name": "secret", "secret": {"secretName": f"{name}-secret", "defaultMode": 0o400}},
    ]


MOUNTS = [
    {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
    {"name": "secret", "mountPath": SECRET_DIR, "readOnly": True},
]


def supervised(name: str, command: str) -> str:
    """The container's script: SIGTERM (the pod deleted) ends ddiloco cleanly and the
    container; SIGUSR1 ends the run (ddiloco stops cleanly) and leaves the container idle;
    so do exit 0 and 78; any other exit ends the container, which the kubelet restarts."""
    return f"""\
{BASH_CHILD}trap 'ending=1; [ "$child" -gt 0 ] && kill -TERM "$child" 2>/dev/null' USR1
run_child {command}
rc=$?
[ "$stopping" = 1 ] && exit "$rc"
case "$rc" in
    0) echo "{name}: the run is over; idle until deleted" ;;
    78) echo "{name}: fatal error (exit 78, above): not restarting; idle until deleted" >&2 ;;
    *) [ "${{ending:-0}}" = 1 ] || exit "$rc" ;;
esac
run_child sleep infinity
exit 0
"""


def container(name: str, options: DeployOptions, script: str) -> dict[str, Any]:
    return {
        "name": name,
        "image": options.image,
        "command": ["/bin/bash", "-c", script],
        "volumeMounts": [dict(m) for m in MOUNTS],
    }


def syncer_objects(name: str, options: DeployOptions, p: Plan) -> list[dict[str, Any]]:
    """A headless Service (the StatefulSet's), a Service learners dial, the StatefulSet."""
    meta, select = labels(name, "syncer"), labels(name, "syncer")
    port = {"name": "syncer", "port": p.port, "targetPort": p.port, "protocol": "TCP"}
    headless = _service(f"{name}-syncer-headless", options, meta, [port], headless=True)
    service = _service(f"{name}-syncer", options, meta, [port])
    secret = f"{SECRET_DIR}/secret"
    command = words(
        "ddiloco",
        syncer_args(f"{CONFIG_DIR}/{CONFIG_FILE}", options, p, options.store or STORE_DIR, secret),
    )
    box = container("syncer", options, supervised("syncer", command))
    box["ports"] = [{"name": "syncer", "containerPort": p.port, "protocol": "TCP"}]
    box["volumeMounts"].append({"name": "store", "mountPath": options.store or STORE_DIR})
    box["resources"] = {"requests": {"cpu": str(options.syncer_cpus)}}
    claim: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": options.storage}},
    }
    if options.storage_class:
        claim["storageClassName"] = options.storage_class
    spec = {
        "replicas": 1,
        "serviceName": f"{name}-syncer-headless",
        "selector": {"matchLabels": select},
        "template": {
            "metadata": {"labels": meta},
            "spec": {
                "terminationGracePeriodSeconds": 120,  # SIGTERM: evaluate, summarize, stop
                "containers": [box],
                "volumes": volumes(name),
            },
        },
        "volumeClaimTemplates": [{"metadata": {"name": "store"}, "spec": claim}],
    }
    stateful = _object("apps/v1", "StatefulSet", f"{name}-syncer", options, meta, spec)
    return [headless, service, stateful]


def learner_script(name: str, options: DeployOptions, p: Plan) -> str:
    """Learner ``${HOSTNAME##*-}`` (the pod ordinal), ``--join`` after a restart."""
    args = [
        *["learner", "--syncer", f"{name}-syncer.{options.namespace}.svc:{p.port}"],
        *["--id", Raw('"$id"'), "--peer-host", Raw('"$POD_IP"'), "--state-dir", STATE_DIR],
        *learner_args(f"{CONFIG_DIR}/{CONFIG_FILE}", options, f"{SECRET_DIR}/secret", p.peer_port),
    ]
    command = words(torchrun(p) if p.ranks > 1 else ["ddiloco"], args, [Raw("$join")])
    return f"""\
id="${{HOSTNAME##*-}}"  # the StatefulSet pod's ordinal: pod {name}-learner-3 is learner 3
case "$id" in
    "" | *[!0-9]*) echo "learner: no pod ordinal in HOSTNAME=$HOSTNAME" >&2; exit 78 ;;
esac
join=""
if [ -e "$DDILOCO_STARTED" ]; then
    join=--join  # the kubelet restarted this container: copy a peer, never start at step 0
fi
touch "$DDILOCO_STARTED"
{supervised("learner $id", command)}"""


def learner_objects(name: str, options: DeployOptions, p: Plan) -> list[dict[str, Any]]:
    """A headless Service (the pods' DNS names) and the learners' StatefulSet."""
    meta = labels(name, "learner")
    ports = [p.peer_port + r for r in range(p.peer_ports)]  # a sharded learner's: one a rank
    names = ["peer"] if len(ports) == 1 else [f"peer-{r}" for r in range(len(ports))]
    peers = [{"name": n, "port": q, "targetPort": q, "protocol": "TCP"}
             for n, q in zip(names, ports, strict=True)]  # fmt: skip
    headless = _service(f"{name}-learner", options, meta, peers, headless=True)
    box = container("learner", options, learner_script(name, options, p))
    box["ports"] = [{"name": n, "containerPort": q, "protocol": "TCP"}
                    for n, q in zip(names, ports, strict=True)]  # fmt: skip
    box["env"] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "DDILOCO_STARTED", "value": STARTED},
    ]
    box["volumeMounts"].append({"name": "state", "mountPath": STATE_DIR})
    pod_volumes = [*volumes(name), {"name": "state", "emptyDir": {}}]
    if p.ranks > 1:  # torchrun's ranks share tensors through /dev/shm
        box["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
        pod_volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    if p.gpus:
        box["resources"] = {"limits": {"nvidia.com/gpu": str(p.gpus)}}
    spec = {
        "replicas": p.learners,
        "podManagementPolicy": "Parallel",
        "serviceName": f"{name}-learner",
        "selector": {"matchLabels": meta},
        "template": {
            "metadata": {"labels": meta},
            "spec": {
                "terminationGracePeriodSeconds": 60,  # SIGTERM: a clean leave
                "containers": [box],
                "volumes": pod_volumes,
            },
        },
    }
    return [headless, _object("apps/v1", "StatefulSet", f"{name}-learner", options, meta, spec)]


def _object(
    api: str, kind: str, name: str, options: DeployOptions, meta: dict[str, str], spec: Any
) -> dict[str, Any]:
    metadata = {"name": name, "namespace": options.namespace, "labels": meta}
    return {"apiVersion": api, "kind": kind, "metadata": metadata, "spec": spec}


def _service(
    name: str,
    options: DeployOptions,
    meta: dict[str, str],
    ports: list[Any],
    headless: bool = False,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": dict(meta), "ports": ports}
    if headless:
        spec |= {"clusterIP": "None", "publishNotReadyAddresses": True}
    return _object("v1", "Service", name, options, meta, spec)


def readme(name: str, options: DeployOptions, p: Plan) -> str:
    ns, secret = options.namespace, options.secret_file or SECRET_FILE
    gpus = f"{p.gpus} GPU(s) each (`nvidia.com/gpu`)" if p.gpus else "no GPUs"
    return f"""\
# Run `{options.run_id}` on Kubernetes

Written by `ddiloco deploy kubernetes`: image `{options.image}`, namespace `{ns}`.

- `{CONFIG_FILE}`: the run config, also in `configmap.yaml` (mounted at `{CONFIG_DIR}`)
- `syncer.yaml`: Services `{name}-syncer` (port {p.port}) and `{name}-syncer-headless`,
  StatefulSet `{name}-syncer` (its store on a {options.storage} claim)
- `learners.yaml`: headless Service `{name}-learner`, StatefulSet `{name}-learner`:
  {p.learners} pods, {p.ranks} rank(s), {gpus}, peer port {p.peer_port}

The secret is not in a manifest (one would end up in version control): make it from
`{secret}` (mode 0600), then apply the rest, from this directory.

```bash
kubectl create namespace {ns} --dry-run=client -o yaml | kubectl apply -f -
kubectl -n {ns} create secret generic {name}-secret --from-file=secret={secret}
kubectl -n {ns} apply -f configmap.yaml -f syncer.yaml -f learners.yaml
kubectl -n {ns} get pods -l app.kubernetes.io/instance={name} -w
kubectl -n {ns} logs -f {name}-syncer-0        # events: @event {{"kind": ...}} lines
kubectl -n {ns} logs {name}-syncer-0 | grep '"kind": "summary"'   # the summary, at the end
kubectl -n {ns} exec {name}-syncer-0 -- bash -c 'kill -USR1 1'   # clean stop of the run
kubectl -n {ns} delete -f learners.yaml -f syncer.yaml -f configmap.yaml
kubectl -n {ns} delete secret {name}-secret; kubectl -n {ns} delete pvc store-{name}-syncer-0
```

Learner m is pod `{name}-learner-m`. A container restarted by the kubelet rejoins with
`--join` (a marker in the pod's emptyDir); a rescheduled pod starts fresh and joins as a late
starter. After the run (exit 0) or a fatal error (exit 78: read the log) containers stay idle
instead of being restarted. The secret file is mounted with mode 0400, readable by root only:
an image that runs as another user can set `DDILOCO_SECRET` from the Secret instead
(`env[].valueFrom.secretKeyRef`, and drop `--secret-file`); do not set `fsGroup`, which
makes the file group-readable and ddiloco refuses it.
"""
