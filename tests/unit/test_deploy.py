"""``ddiloco deploy``: every generated file parsed and checked, and the scripts executed.

Kubernetes manifests are validated against the Kubernetes OpenAPI schemas that
kubernetes-validate bundles (offline); the RayCluster, which has none there, against the
fields the KubeRay CRD (ray.io_rayclusters.yaml, v1) requires, its pod templates as
Kubernetes PodTemplates. The container command and the SLURM scripts run under bash with
fake ``ddiloco``/``torchrun``/``srun``/``sleep`` on PATH that record their argv. Also the
learners' fixed peer-recovery port (``processes.peer_port``, ``--peer-port``).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.cli import main
from ddiloco.config import load_config, to_toml
from ddiloco.deploy import generate
from ddiloco.deploy.common import DeployOptions, to_yaml, yaml_documents
from ddiloco.errors import ConfigError
from ddiloco.runtime.processes.learner.peer import SnapshotServer

SECRET = bytes(range(32))
CONFIG = """\
name = "exp42"
runtime = "processes"
model = "gpt-tiny"
methods = ["decoupled"]

[train]
learners = 3
device = "cuda"

[processes]
bind = "0.0.0.0:5555"
peer_port = 5600
"""
K8S_VERSION = kubernetes_validate.latest_version()


def config_file(tmp_path: Path, text: str = CONFIG, *sets: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text + "".join(f"{s}\n" for s in sets))
    return path


def files_for(engine: str, text: str = CONFIG, sets: tuple[str, ...] = (), **options: Any):
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(config_file(Path(tmp), text), list(sets))
    options.setdefault("run_id", "exp42")
    options.setdefault("home", "/shared/exp42")
    if engine != "slurm":
        options.setdefault("image", "ghcr.io/example/ddiloco:1")
    return generate(engine, config, text, DeployOptions(**options))


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def by_kind(files: dict[str, str]) -> dict[tuple[str, str], dict[str, Any]]:
    objects = [d for name, text in files.items() if name.endswith(".yaml") for d in docs(text)]
    return {(d["kind"], d["metadata"]["name"]): d for d in objects}


# -- the YAML writer --------------------------------------------------------------------------
YAML_VALUES = st.recursive(
    st.none().map(lambda _: "x")
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.text(max_size=30)
    | st.sampled_from(["yes", "no", "on", "null", "0400", "1.0", "a: b", "- x", "#", "~", " a"]),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(min_size=1, max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(YAML_VALUES)
def test_the_yaml_writer_is_read_back_as_written(value):
    assert yaml.safe_load(to_yaml({"v": value})) == {"v": value}


def test_a_script_is_a_literal_block_read_back_exactly():
    script = 'echo "$x"\n  if [ a ]; then\n\n    exit 78\n  fi\n'
    text = to_yaml({"a": script, "b": script.rstrip("\n")})
    assert "a: |\n" in text and "b: |-\n" in text
    assert yaml.safe_load(text) == {"a": script, "b": script.rstrip("\n")}
    assert list(yaml.safe_load_all(yaml_documents({"a": 1}, {"b": 2}))) == [{"a": 1}, {"b": 2}]


# -- Kubernetes -------------------------------------------------------------------------------
def test_every_kubernetes_manifest_is_valid_against_the_openapi_schemas():
    files = files_for("kubernetes", gpus_per_learner=2, namespace="ml")
    assert set(files) == {"run.toml", "configmap.yaml", "syncer.yaml", "learners.yaml", "README.md"}
    objects = by_kind(files)
    assert {k for k, _ in objects} == {"ConfigMap", "Service", "StatefulSet"}
    for obj in objects.values():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        assert obj["metadata"]["namespace"] == "ml"
    broken = json.loads(json.dumps(objects["StatefulSet", "exp42-learner"]))
    broken["spec"]["template"]["spec"]["containers"][0]["gpus"] = 2  # no such field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_the_syncer_statefulset_keeps_its_store_on_a_claim_behind_two_services():
    objects = by_kind(files_for("kubernetes", store="/data/store", storage="50Gi"))
    sts = objects["StatefulSet", "exp42-syncer"]
    assert sts["spec"]["replicas"] == 1
    assert sts["spec"]["serviceName"] == "exp42-syncer-headless"
    claim = sts["spec"]["volumeClaimTemplates"][0]
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    box = sts["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in box["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == "/data/store"
    script = box["command"][2]
    assert "--store /data/store" in script and "--bind 0.0.0.0:5555" in script
    assert box["ports"] == [{"name": "syncer", "containerPort": 5555, "protocol": "TCP"}]
    headless = objects["Service", "exp42-syncer-headless"]["spec"]
    service = objects["Service", "exp42-syncer"]["spec"]
    assert headless["clusterIP"] == "None" and "clusterIP" not in service
    assert service["ports"][0]["port"] == 5555
    labels = sts["spec"]["template"]["metadata"]["labels"]
    for spec in (headless, service):
        assert spec["selector"].items() <= labels.items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_learner_statefulset_runs_one_pod_per_learner_with_its_gpus_and_peer_port():
    files = files_for("kubernetes", gpus_per_learner=2)
    sts = by_kind(files)["StatefulSet", "exp42-learner"]["spec"]
    assert sts["replicas"] == 3 and sts["podManagementPolicy"] == "Parallel"
    pod = sts["template"]["spec"]
    box = pod["containers"][0]
    assert box["ports"] == [{"name": "peer", "containerPort": 5600, "protocol": "TCP"}]
    assert box["resources"]["limits"]["nvidia.com/gpu"] == "2"
    env = {e["name"]: e for e in box["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["secret"]["secret"]["defaultMode"] == 0o400
    assert "emptyDir" in volumes["state"]
    config = by_kind(files)["ConfigMap", "exp42-config"]["data"]["run.toml"]
    assert config == CONFIG and tomllib.loads(config)["processes"]["peer_port"] == 5600
    assert all(d["kind"] != "Secret" for d in by_kind(files).values())  # never in a manifest


def fakes(tmp_path: Path) -> dict[str, str]:
    """A PATH with recording fakes; returns the environment that uses them."""
    bin_dir, rec = tmp_path / "bin", tmp_path / "rec"
    bin_dir.mkdir()
    rec.mkdir()
    recorder = """#!/bin/bash
n=$(( $(cat "$FAKE_REC/count" 2>/dev/null || echo 0) + 1 ))
echo "$n" > "$FAKE_REC/count"
{ printf '%s\\n' "$(basename "$0")"; printf '%s\\n' "$@"; } > "$FAKE_REC/call.$n"
if [ -n "${FAKE_MOVE:-}" ] && [ "$n" = 1 ]; then echo "$FAKE_MOVE" > syncer.address; fi
if [ "$(basename "$0")" = sbatch ]; then echo "$((100 + n));cluster"; fi
if [ -n "${FAKE_WAIT:-}" ]; then
    trap 'echo TERM >> "$FAKE_REC/signals"; exit 0' TERM
    touch "$FAKE_REC/started"
    while :; do /bin/sleep 0.05; done
fi
rcs=(${FAKE_RCS:-0})
exit "${rcs[$((n - 1))]:-0}"
"""
    for name in ("ddiloco", "torchrun", "srun", "sbatch"):
        (bin_dir / name).write_text(recorder)
    (bin_dir / "sleep").write_text('#!/bin/bash\necho "$@" >> "$FAKE_REC/sleep"\n')
    (bin_dir / "hostname").write_text("#!/bin/bash\necho fakehost\n")
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'nodeA\\nnodeB\\n'\n")
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_REC": str(rec), "HOME": str(tmp_path)}


def calls(env: dict[str, str]) -> list[list[str]]:
    rec = Path(env["FAKE_REC"])
    count = int((rec / "count").read_text()) if (rec / "count").exists() else 0
    return [(rec / f"call.{n}").read_text().splitlines() for n in range(1, count + 1)]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def run_container(box: dict[str, Any], env: dict[str, str], **extra: str):
    values = {e["name"]: e.get("value", "") for e in box.get("env", [])}
    values |= {"POD_IP": "10.1.2.3", **env, **extra}
    return subprocess.run(box["command"], env=values, capture_output=True, text=True, timeout=20)


def learner_box(tmp_path: Path, **options: Any) -> tuple[dict[str, Any], dict[str, str]]:
    sts = by_kind(files_for("kubernetes", namespace="ml", **options))[
        "StatefulSet", "exp42-learner"
    ]
    box = sts["spec"]["template"]["spec"]["containers"][0]
    env = fakes(tmp_path)
    env["DDILOCO_STARTED"] = str(tmp_path / "started")  # the emptyDir's marker
    return box, env


def test_the_pod_ordinal_is_the_learner_id_and_a_restarted_container_joins(tmp_path):
    box, env = learner_box(tmp_path)
    assert box["command"][:2] == ["/bin/bash", "-c"]
    first = run_container(box, env, HOSTNAME="exp42-learner-2")  # exits 0: the run is over
    assert first.returncode == 0, first.stderr
    argv = calls(env)[0]
    assert argv[:2] == ["ddiloco", "learner"] and "--join" not in argv
    assert flag(argv, "--id") == "2" and flag(argv, "--peer-host") == "10.1.2.3"
    assert flag(argv, "--peer-port") == "5600" and flag(argv, "--peer-bind") == "0.0.0.0"
    assert flag(argv, "--syncer") == "exp42-syncer.ml.svc:5555"
    assert flag(argv, "--secret-file") == "/etc/ddiloco/secret/secret"
    assert (Path(env["FAKE_REC"]) / "sleep").read_text() == "infinity\n"  # idle, not restarted
    crashed = run_container(box, env | {"FAKE_RCS": "0 1"}, HOSTNAME="exp42-learner-2")
    assert crashed.returncode == 1  # the kubelet restarts the container...
    assert flag(calls(env)[1], "--id") == "2" and "--join" in calls(env)[1]  # ...which joined


def test_exit_78_idles_the_container_and_a_hostname_without_ordinal_is_refused(tmp_path):
    box, env = learner_box(tmp_path)
    fatal = run_container(box, env | {"FAKE_RCS": "78"}, HOSTNAME="exp42-learner-0")
    assert fatal.returncode == 0 and "exit 78" in fatal.stderr
    assert (Path(env["FAKE_REC"]) / "sleep").exists()
    odd = run_container(box, env, HOSTNAME="learner")
    assert odd.returncode == 78 and "no pod ordinal" in odd.stderr


def signalled_once_started(command: list[str], env: dict[str, str], sig: int) -> int:
    """Run a container's ``command`` until its (fake) ddiloco has started, send it ``sig``:
    the container's exit status."""
    proc = subprocess.Popen(command, env=env, text=True)
    started = Path(env["FAKE_REC"]) / "started"
    deadline = time.monotonic() + 10
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(sig)
    return proc.wait(timeout=10)


def test_sigterm_to_the_container_ends_ddiloco_cleanly_and_the_container(tmp_path):
    box, env = learner_box(tmp_path)
    values = {e["name"]: e.get("value", "") for e in box["env"]}
    values |= env | {"POD_IP": "10.0.0.1", "HOSTNAME": "x-learner-1", "FAKE_WAIT": "1"}
    assert signalled_once_started(box["command"], values, signal.SIGTERM) == 0
    assert (Path(env["FAKE_REC"]) / "signals").read_text() == "TERM\n"
    assert not (Path(env["FAKE_REC"]) / "sleep").exists()  # not idle: the pod is going away


def test_a_data_parallel_learner_runs_torchrun_with_its_ranks(tmp_path):
    box, env = learner_box(tmp_path, sets=("processes.ranks=4",))
    assert run_container(box, env, HOSTNAME="exp42-learner-1").returncode == 0
    argv = calls(env)[0]
    assert argv[0] == "torchrun" and flag(argv, "--nproc-per-node") == "4"
    assert argv[argv.index("-m") + 1 : argv.index("-m") + 3] == ["ddiloco.cli", "learner"]
    assert flag(argv, "--max-restarts") == "0" and flag(argv, "--id") == "1"
    assert box["resources"]["limits"]["nvidia.com/gpu"] == "4"  # one per rank on CUDA


# -- KubeRay ----------------------------------------------------------------------------------
# From the KubeRay CRD ray.io_rayclusters.yaml, version v1 (kuberay master, 2025): spec needs
# headGroupSpec; headGroupSpec needs template; each workerGroupSpecs item needs groupName,
# minReplicas, maxReplicas, template; rayStartParams maps to strings.
SPEC_FIELDS = {"headGroupSpec", "workerGroupSpecs", "rayVersion", "enableInTreeAutoscaling"}
HEAD_FIELDS = {"template", "rayStartParams", "serviceType", "enableIngress", "headService"}
WORKER_FIELDS = {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams"}
WORKER_FIELDS |= {"template", "numOfHosts", "scaleStrategy", "suspend", "idleTimeoutSeconds"}


def check_pod_template(template: dict[str, Any]) -> None:
    kubernetes_validate.validate(
        {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "t"},
            "template": template,
        },
        K8S_VERSION,
        strict=True,
    )


def test_the_raycluster_has_the_crd_s_required_fields_and_valid_pod_templates():
    files = files_for("kuberay", sets=("ray.syncer_resource='cpu_box'",), ray_version="2.9.0")
    assert set(files) == {"run.toml", "configmap.yaml", "raycluster.yaml", "README.md"}
    (cluster,) = docs(files["raycluster.yaml"])
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", cluster["metadata"]["name"])
    spec = cluster["spec"]
    assert set(spec) <= SPEC_FIELDS and spec["rayVersion"] == "2.9.0"
    head = spec["headGroupSpec"]
    assert set(head) <= HEAD_FIELDS and "template" in head
    check_pod_template(head["template"])
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == {"syncer", "learners"}
    for group in [head, *groups.values()]:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
    for group in groups.values():
        assert set(group) <= WORKER_FIELDS
        assert {"groupName", "minReplicas", "maxReplicas", "template"} <= set(group)
        assert group["minReplicas"] == group["replicas"] == group["maxReplicas"]
        check_pod_template(group["template"])
    custom = json.loads(json.loads(groups["syncer"]["rayStartParams"]["resources"]))
    assert custom == {"cpu_box": 1} and groups["syncer"]["replicas"] == 1
    assert groups["learners"]["replicas"] == 3  # a pod per learner
    box = groups["learners"]["template"]["spec"]["containers"][0]
    assert box["resources"]["limits"]["nvidia.com/gpu"] == "1"  # one per rank on CUDA
    assert "ddiloco train --runtime ray --config /etc/ddiloco/config/run.toml" in files["README.md"]
    kubernetes_validate.validate(docs(files["configmap.yaml"])[0], K8S_VERSION, strict=True)


def test_the_raycluster_has_no_syncer_group_when_the_syncer_may_go_anywhere():
    (cluster,) = docs(files_for("kuberay", sets=("ray.syncer_resource=''",))["raycluster.yaml"])
    assert [g["groupName"] for g in cluster["spec"]["workerGroupSpecs"]] == ["learners"]
    default = docs(files_for("kuberay")["raycluster.yaml"])[0]["spec"]["workerGroupSpecs"][0]
    assert json.loads(json.loads(default["rayStartParams"]["resources"])) == {"ddiloco_syncer": 1}


# -- SLURM ------------------------------------------------------------------------------------
def sbatch_lines(script: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line.removeprefix("#SBATCH ").partition("=")
            out[key] = value
    return out


def test_every_slurm_script_parses_and_asks_for_what_the_run_needs(tmp_path):
    files = files_for("slurm", gpus_per_learner=4, partition="gpu", time="1:00:00", account="ml")
    assert set(files) == {
        "run.toml",
        "README.md",
        "syncer.sbatch",
        "submit.sh",
        *(f"learner-{m}.sbatch" for m in range(3)),
    }
    for name, text in files.items():
        if name.endswith((".sbatch", ".sh")):
            (tmp_path / name).write_text(text)
            check = subprocess.run(["bash", "-n", str(tmp_path / name)], capture_output=True)
            assert check.returncode == 0, (name, check.stderr)
            assert "DDILOCO_SECRET" not in text  # the secret is a file, never on a command line
            assert name == "submit.sh" or "--secret-file run.secret" in text
    syncer = sbatch_lines(files["syncer.sbatch"])
    assert syncer["--job-name"] == "exp42-syncer" and syncer["--chdir"] == "/shared/exp42"
    assert "--gres" not in syncer and syncer["--cpus-per-task"] == "2" and "--requeue" in syncer
    for m in range(3):
        job = sbatch_lines(files[f"learner-{m}.sbatch"])
        assert job["--job-name"] == f"exp42-learner-{m}" and "--requeue" in job
        assert job["--gres"] == "gpu:4" and job["--nodes"] == "1" and job["--partition"] == "gpu"
        assert job["--time"] == "1:00:00" and job["--account"] == "ml"
        assert job["--output"] == f"logs/learner-{m}-%j.log" and job["--open-mode"] == "append"


def slurm_dir(tmp_path: Path, sets: tuple[str, ...] = (), **options: Any) -> Path:
    home = tmp_path / "run"
    home.mkdir(parents=True)
    for name, text in files_for("slurm", sets=sets, home=str(home), **options).items():
        (home / name).write_text(text)
    return home


def run_script(home: Path, env: dict[str, str], name: str, *args: str, **extra: str):
    cmd = ["bash", str(home / name), *args]
    return subprocess.run(
        cmd, cwd=home, env=env | extra, capture_output=True, text=True, timeout=20
    )


def test_a_slurm_learner_reads_the_syncer_address_restarts_a_crash_with_join(tmp_path):
    home, env = slurm_dir(tmp_path), fakes(tmp_path)
    (home / "syncer.address").write_text("node7:5555\n")
    done = run_script(home, env, "learner-1.sbatch", FAKE_RCS="1 0")
    assert done.returncode == 0, done.stderr
    first, second = calls(env)
    assert first[:2] == ["ddiloco", "learner"] and "--join" not in first
    assert flag(first, "--syncer") == "node7:5555" and flag(first, "--id") == "1"
    assert flag(first, "--peer-host") == "fakehost" and flag(first, "--peer-port") == "5601"
    assert flag(first, "--state-dir") == "state/learner-1"
    assert "--join" in second and "restart 1 of 5" in done.stderr


def test_a_requeued_slurm_learner_joins_and_exit_78_is_never_restarted(tmp_path):
    home, env = slurm_dir(tmp_path), fakes(tmp_path)
    (home / "syncer.address").write_text("node7:5555\n")
    fatal = run_script(home, env, "learner-0.sbatch", FAKE_RCS="78", SLURM_RESTART_COUNT="1")
    assert fatal.returncode == 78
    (only,) = calls(env)
    assert "--join" in only


def test_a_slurm_learner_follows_a_syncer_that_moved(tmp_path):
    home, env = slurm_dir(tmp_path), fakes(tmp_path)
    (home / "syncer.address").write_text("node7:5555\n")
    moved = run_script(home, env, "learner-0.sbatch", FAKE_RCS="78 0", FAKE_MOVE="node9:5555")
    assert moved.returncode == 0, moved.stderr
    first, second = calls(env)
    assert flag(first, "--syncer") == "node7:5555" and "--join" not in first
    assert flag(second, "--syncer") == "node9:5555" and "--join" in second


def test_the_slurm_syncer_writes_its_address_and_binds_every_interface(tmp_path):
    home, env = slurm_dir(tmp_path, store="/scratch/store"), fakes(tmp_path)
    done = run_script(home, env, "syncer.sbatch")
    assert done.returncode == 0, done.stderr
    assert (home / "syncer.address").read_text() == "fakehost:5555\n"
    (argv,) = calls(env)
    assert argv[:2] == ["ddiloco", "syncer"] and flag(argv, "--bind") == "0.0.0.0:5555"
    assert flag(argv, "--store") == "/scratch/store" and flag(argv, "--run-id") == "exp42"
    pinned = slurm_dir(tmp_path / "p", syncer_host="cpu01")
    assert sbatch_lines((pinned / "syncer.sbatch").read_text())["--nodelist"] == "cpu01"


def test_a_multi_node_slurm_learner_runs_srun_torchrun_on_every_node(tmp_path):
    home = slurm_dir(tmp_path, sets=("processes.ranks=4",), nodes_per_learner=2)
    env = fakes(tmp_path)
    (home / "syncer.address").write_text("node7:5555\n")
    job = sbatch_lines((home / "learner-0.sbatch").read_text())
    assert job["--nodes"] == "2" and job["--ntasks-per-node"] == "1" and job["--gres"] == "gpu:2"
    assert run_script(home, env, "learner-0.sbatch", SLURM_JOB_ID="41").returncode == 0
    (srun,) = calls(env)
    assert srun[0] == "srun" and "--nodes=2" in srun
    assert srun[srun.index("--node") - 1 :][:5] == [
        "learner-0.sbatch",
        "--node",
        "node7:5555",
        "nodeA",
        "0",
    ]
    # what srun runs on each node: torchrun's rendezvous on the first node, rank 0 talks
    node = run_script(
        home,
        env,
        "learner-0.sbatch",
        "--node",
        "node7:5555",
        "nodeA",
        "3",
        "--join",
        SLURM_JOB_ID="41",
    )
    assert node.returncode == 0, node.stderr
    torch = calls(env)[1]
    assert torch[0] == "torchrun" and flag(torch, "--nnodes") == "2"
    assert (
        flag(torch, "--nproc-per-node") == "2" and flag(torch, "--rdzv-endpoint") == "nodeA:29400"
    )
    assert flag(torch, "--rdzv-id") == "41-3" and torch[-1] == "--join"
    assert flag(torch, "--syncer") == "node7:5555" and flag(torch, "--peer-host") == "fakehost"


def test_submit_sh_submits_the_syncer_then_the_learners_after_it(tmp_path):
    home, env = slurm_dir(tmp_path), fakes(tmp_path)
    (home / "syncer.address").write_text("stale:1\n")
    done = run_script(home, env, "submit.sh", FAKE_RCS="0")
    assert done.returncode == 0, done.stderr
    assert not (home / "syncer.address").exists()  # a previous run's address is not read
    syncer, *learners = calls(env)
    assert syncer[1:] == ["--parsable", "syncer.sbatch"]
    assert [c[-1] for c in learners] == [f"learner-{m}.sbatch" for m in range(3)]
    assert all("--dependency=after:101" in c for c in learners)
    jobs = (home / "jobs.txt").read_text()
    assert jobs == "syncer 101\nlearner-0 102\nlearner-1 103\nlearner-2 104\n"


# -- the command and its errors ---------------------------------------------------------------
def test_deploy_writes_the_config_a_private_secret_and_executable_scripts(tmp_path, capsys):
    path = config_file(tmp_path)
    out = tmp_path / "out"
    assert main(["deploy", "slurm", "--config", str(path), "--out", str(out)]) == 0
    assert (out / "run.toml").read_text() == CONFIG
    assert (out / "run.secret").stat().st_mode & 0o777 == 0o600
    assert len(bytes.fromhex((out / "run.secret").read_text())) == 32
    assert (out / "submit.sh").stat().st_mode & 0o111 and (out / "logs").is_dir()
    assert f"--chdir={out}" in (out / "syncer.sbatch").read_text()
    secret = (out / "run.secret").read_text()
    assert main(["deploy", "slurm", "--config", str(path), "--out", str(out)]) == 0
    assert (out / "run.secret").read_text() == secret  # kept: running jobs hold it
    assert all(
        secret.strip() not in p.read_text()
        for p in out.iterdir()
        if p.name != "run.secret" and p.is_file()
    )


def test_deploy_with_set_writes_the_resolved_config_every_process_reads(tmp_path):
    out = tmp_path / "out"
    argv = ["deploy", "kubernetes", "--config", str(config_file(tmp_path)), "--out", str(out)]
    assert main([*argv, "--image", "img:1", "--set", "train.learners=5"]) == 0
    config = load_config(out / "run.toml")
    assert config.train.learners == 5 and config.processes.peer_port == 5600
    assert (
        by_kind({"l.yaml": (out / "learners.yaml").read_text()})["StatefulSet", "exp42-learner"][
            "spec"
        ]["replicas"]
        == 5
    )


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["kubernetes"], "--image"),
        (["kuberay", "--image", "i", "--partition", "gpu"], "--partition"),
        (["slurm", "--image", "i"], "--image"),
        (["kuberay", "--image", "i", "--secret-file", "s"], "--secret-file"),
        (["slurm", "--nodes-per-learner", "2"], "--nodes-per-learner"),  # ranks = 1
        (["kuberay", "--image", "i", "--nodes-per-learner", "1"], "--nodes-per-learner"),
        (["slurm", "--peer-port", "5555"], "--peer-port"),  # the syncer's port
        (["kubernetes", "--image", "i", "--run-id", "!!"], "--run-id"),
        (["slurm", "--method", "data_parallel"], "--method"),
        (["slurm", "--set", "train.device='cpu'", "--gpus-per-learner", "1"], "--gpus-per-learner"),
    ],
)
def test_deploy_refuses_what_cannot_run_naming_the_flag(tmp_path, capsys, argv, named):
    engine, *rest = argv
    base = ["deploy", engine, "--config", str(config_file(tmp_path)), "--out", str(tmp_path / "o")]
    assert main([*base, *rest]) == 2
    assert f"error: {named}=" in capsys.readouterr().err


def test_deploy_needs_a_config_and_a_private_secret_file(tmp_path, capsys):
    assert main(["deploy", "slurm", "--out", str(tmp_path / "o")]) == 2
    assert "--config" in capsys.readouterr().err
    loose = tmp_path / "loose.secret"
    loose.write_text(SECRET.hex())
    loose.chmod(0o644)
    argv = ["deploy", "slurm", "--config", str(config_file(tmp_path)), "--out", str(tmp_path / "o")]
    assert main([*argv, "--secret-file", str(loose)]) == 2
    assert "chmod 600" in capsys.readouterr().err
    loose.chmod(0o600)
    assert main([*argv, "--secret-file", str(loose)]) == 0
    assert not (tmp_path / "o" / "run.secret").exists()
    assert f"--secret-file {loose}" in (tmp_path / "o" / "learner-0.sbatch").read_text()


# -- the fixed peer-recovery port -------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_snapshot_server_binds_the_port_asked_and_advertises_another_host():
    port = free_port()
    server = SnapshotServer("127.0.0.1", "run", SECRET, 0, port=port, advertise_host="10.0.0.7")
    server.start()
    try:
        assert server.address == f"10.0.0.7:{port}"  # what the syncer hands to peers
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # listening where asked
    finally:
        server.close()
    free = SnapshotServer("127.0.0.1", "run", SECRET, 1)  # 0: a free port, as before
    free.start()
    free.close()
    assert re.fullmatch(r"127\.0\.0\.1:\d+", free.address)


def test_a_taken_peer_port_is_refused_naming_it():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError) as refused:
            SnapshotServer("127.0.0.1", "run", SECRET, 0, port=port)
    assert refused.value.field == "--peer-port" and refused.value.value == port
    assert f"127.0.0.1:{port}" in str(refused.value) and "another process holds it" in str(
        refused.value
    )


def test_peer_port_in_the_config_and_on_the_learner_command_line():
    assert load_config(None, ["processes.peer_port=6000"]).processes.peer_port == 6000
    assert load_config(None, []).processes.peer_port == 0
    for bad in ("-1", "65536"):
        with pytest.raises(ConfigError, match=r"processes\.peer_port"):
            load_config(None, [f"processes.peer_port={bad}"])
    again = tomllib.loads(to_toml(load_config(None, ["processes.peer_port=6000"])))
    assert again["processes"]["peer_port"] == 6000
    from ddiloco.cli import build_parser

    args = build_parser().parse_args(["learner", "--id", "0"])
    assert args.peer_port is None and args.peer_bind is None  # the config's; --peer-host
    args = build_parser().parse_args(
        ["learner", "--id", "0", "--peer-port", "7000", "--peer-bind", "0.0.0.0"]
    )
    assert (args.peer_port, args.peer_bind) == (7000, "0.0.0.0")


def test_the_multi_host_config_in_docs_deploy_md_loads_and_deploys(tmp_path):
    text = (Path(__file__).parents[2] / "docs" / "deploy.md").read_text()
    recipes = text[text.index("## Recipes: SLURM, Kubernetes, KubeRay") :]
    example = recipes[
        recipes.index("```toml\n") + 8 : recipes.index("\n```", recipes.index("```toml"))
    ]
    config = load_config(config_file(tmp_path, example + "\n"))
    assert config.processes.bind == "0.0.0.0:5555" and config.processes.peer_port == 5556
    for engine in ("slurm", "kubernetes", "kuberay"):
        assert "README.md" in files_for(engine, example + "\n")


def test_deploy_kuberay_makes_no_secret_its_runtime_makes_one(tmp_path):
    out = tmp_path / "out"
    argv = ["deploy", "kuberay", "--config", str(config_file(tmp_path)), "--out", str(out)]
    assert main([*argv, "--image", "rayproject/ray:2.9.0"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "configmap.yaml",
        "raycluster.yaml",
        "run.toml",
    ]


def test_sigusr1_to_the_syncer_container_ends_the_run_and_leaves_it_idle(tmp_path):
    sts = by_kind(files_for("kubernetes"))["StatefulSet", "exp42-syncer"]
    box = sts["spec"]["template"]["spec"]["containers"][0]
    env = fakes(tmp_path)
    assert signalled_once_started(box["command"], env | {"FAKE_WAIT": "1"}, signal.SIGUSR1) == 0
    (argv,) = calls(env)
    assert argv[:2] == ["ddiloco", "syncer"] and flag(argv, "--bind") == "0.0.0.0:5555"
    assert flag(argv, "--store") == "/var/lib/ddiloco/store"
    assert (Path(env["FAKE_REC"]) / "signals").read_text() == "TERM\n"  # a clean stop
    assert (Path(env["FAKE_REC"]) / "sleep").read_text() == "infinity\n"  # then idle


def test_a_sharded_learners_ranks_each_get_a_peer_port_on_both_engines():
    # rank r of a sharded learner serves its rows on its --peer-port + r: SLURM spaces the
    # learners R ports apart (two may share a node), Kubernetes opens all R on the pod
    sets = ("processes.ranks=2", "train.parallel='fsdp'")
    slurm = files_for("slurm", sets=sets)
    ports = [re.search(r"--peer-port['\" ]+(\d+)", slurm[f"learner-{m}.sbatch"]) for m in (0, 1, 2)]
    assert [int(found[1]) for found in ports if found] == [5600, 5602, 5604]
    assert "5600-5605" in slurm["README.md"] and "rank r of a sharded learner" in slurm["README.md"]
    learners = by_kind(files_for("kubernetes", sets=sets))[("StatefulSet", "exp42-learner")]
    box = learners["spec"]["template"]["spec"]["containers"][0]
    assert [p["containerPort"] for p in box["ports"]] == [5600, 5601]
    ddp = files_for("slurm", sets=("processes.ranks=2",))  # (a DDP learner: rank 0's only)
    assert "5600-5602" in ddp["README.md"]
