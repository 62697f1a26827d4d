"""What every engine's generator shares: the options, the process command lines, a shell
wrapper and a small YAML writer.

Pure functions of the run config and the options (no clock, no randomness, no file system),
so the tests call them and parse what they return. The YAML writer is ours because the
package does not depend on PyYAML; the tests check that PyYAML reads back what it wrote.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddiloco.config import RunConfig
from ddiloco.errors import require

CONFIG_FILE = "run.toml"  # the run config, as copied into the output directory
SECRET_FILE = "run.secret"  # the run secret the deploy command writes (mode 0600)
DEFAULT_PORT = 5555  # the syncer's port when processes.bind names none
DEFAULT_PEER_PORT = 5556  # the learners' peer-recovery port when processes.peer_port is 0
FRAGMENT_METHODS = ("decoupled", "decoupled_sync", "streaming", "diloco")


@dataclass(frozen=True)
class DeployOptions:
    """Everything besides the run config; ``None`` means the engine's default."""

    run_id: str
    home: str = ""  # absolute output directory (SLURM: on a filesystem every node shares)
    method: str = "decoupled"
    port: int | None = None  # the syncer's port (default: processes.bind's, else 5555)
    peer_port: int | None = None  # the learners' recovery port (default: processes.peer_port)
    store: str | None = None  # the syncer's durable state directory
    secret_file: str | None = None  # an existing secret (default: run.secret beside the config)
    gpus_per_learner: int | None = None  # default: train.gpus_per_learner
    nodes_per_learner: int = 1
    # SLURM
    syncer_host: str | None = None  # pin the syncer job to this node (default: any node)
    partition: str | None = None
    syncer_partition: str | None = None  # default: partition
    account: str | None = None
    time: str | None = None
    cpus_per_learner: int | None = None
    syncer_cpus: int = 2
    env_setup: str = ""  # a shell line run first in every job, e.g. "source venv/bin/activate"
    sbatch_extra: tuple[str, ...] = ()  # more #SBATCH options, e.g. "--mem=64G"
    # Kubernetes and KubeRay
    image: str | None = None
    namespace: str = "default"
    storage: str = "10Gi"  # the syncer's volume
    storage_class: str | None = None
    ray_version: str | None = None

    def __post_init__(self) -> None:
        require(bool(self.run_id.strip()), "--run-id", self.run_id, "must not be empty")
        require(
            self.method in FRAGMENT_METHODS,
            "--method",
            self.method,
            f"a syncer and learners run only {', '.join(FRAGMENT_METHODS)}",
        )
        for name in ("port", "peer_port"):
            value = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            require(value is None or 0 < value < 65536, flag, value, "must be in 1..65535")
        require(self.nodes_per_learner >= 1, "--nodes-per-learner", self.nodes_per_learner, ">= 1")
        require(self.syncer_cpus >= 1, "--syncer-cpus", self.syncer_cpus, "must be >= 1")
        for name in ("gpus_per_learner", "cpus_per_learner"):
            value = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            require(value is None or value >= 0, flag, value, "must be >= 0")


@dataclass(frozen=True)
class Plan:
    """The numbers every engine derives the same way from the config and the options."""

    learners: int
    port: int
    peer_port: int
    ranks: int  # data-parallel ranks per learner (processes.ranks)
    nodes: int  # nodes per learner
    gpus: int  # GPUs per learner (all its nodes together)
    sharded: bool = False  # train.parallel = "fsdp": every rank serves its rows to newcomers

    @property
    def ranks_per_node(self) -> int:
        return self.ranks // self.nodes

    @property
    def peer_ports(self) -> int:
        """Ports one learner serves peer recovery on: one a rank when sharded (rank r on
        its ``--peer-port`` + r), else one (rank 0's)."""
        return self.ranks if self.sharded else 1


def plan(config: RunConfig, options: DeployOptions, one_node: str = "") -> Plan:
    """Ports, ranks and GPUs, refusing combinations that cannot run; ``one_node``: why this
    target runs a learner on one node only (refuses ``--nodes-per-learner`` above 1)."""
    bound = config.processes.bind.rpartition(":")[2]
    port = options.port or (int(bound) if bound.isdigit() and int(bound) else DEFAULT_PORT)
    peer_port = options.peer_port or config.processes.peer_port or DEFAULT_PEER_PORT
    require(peer_port != port, "--peer-port", peer_port, f"must differ from the syncer's {port}")
    ranks, nodes = config.processes.ranks, options.nodes_per_learner
    require(not one_node or nodes == 1, "--nodes-per-learner", nodes, one_node)
    require(
        ranks % nodes == 0,
        "--nodes-per-learner",
        nodes,
        f"must divide processes.ranks ({ranks}): every node runs as many ranks",
    )
    gpus = options.gpus_per_learner
    if gpus is None:
        gpus = config.train.gpus_per_learner
        if gpus == 0 and config.train.device.startswith("cuda"):
            gpus = ranks  # one device per rank
    require(
        gpus == 0 or config.train.device.startswith("cuda"),
        "--gpus-per-learner",
        gpus,
        f"train.device is {config.train.device!r}: set train.device = 'cuda' to use GPUs",
    )
    require(gpus % nodes == 0, "--gpus-per-learner", gpus, f"must be a multiple of {nodes} nodes")
    sharded = config.train.parallel == "fsdp"
    return Plan(config.train.learners, port, peer_port, ranks, nodes, gpus, sharded)


def dns_name(run_id: str) -> str:
    """A Kubernetes object name prefix from the run id (lower case, ``-`` for the rest)."""
    name = re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-")
    require(
        bool(name) and len(name) <= 40,
        "--run-id",
        run_id,
        "needs 1..40 letters, digits or '-' for Kubernetes names (e.g. exp42)",
    )
    return name


def words(*parts: str | Sequence[str]) -> str:
    """A shell command line: plain strings are quoted, ``Raw`` ones (shell expansions) not."""
    out: list[str] = []
    for part in parts:
        for word in [part] if isinstance(part, str) else part:
            out.append(str(word) if isinstance(word, Raw) else shlex.quote(word))
    return " ".join(out)


class Raw(str):
    """A word the shell must expand (``"$POD_IP"``), written as is by :func:`words`."""


def syncer_args(
    config_path: str, options: DeployOptions, p: Plan, store: str, secret: str
) -> list[str]:
    """``ddiloco syncer`` on every interface (the engine's network decides who reaches it)."""
    return [
        *["syncer", "--bind", f"0.0.0.0:{p.port}", "--config", config_path],
        *["--run-id", options.run_id, "--secret-file", secret, "--store", store],
        *["--method", options.method, "--threads", str(options.syncer_cpus)],
    ]


def learner_args(
    config_path: str, options: DeployOptions, secret: str, peer_port: int
) -> list[str]:
    """``ddiloco learner`` minus what the engine fills in at run time (id, addresses)."""
    return [
        *["--config", config_path, "--run-id", options.run_id, "--secret-file", secret],
        *["--method", options.method, "--peer-port", str(peer_port), "--peer-bind", "0.0.0.0"],
    ]


def torchrun(p: Plan, rendezvous: Sequence[str] = ()) -> list[str]:
    """The torchrun prefix of a data-parallel learner (only rank 0 talks to the syncer);
    torchrun never restarts it itself: a restart must take the ``--join`` path."""
    where = list(rendezvous) or ["--standalone"]
    return [
        *["torchrun", *where, "--nproc-per-node", str(p.ranks_per_node)],
        *["--max-restarts", "0", "-m", "ddiloco.cli"],
    ]


# Bash: run a command in the background and wait for it, so that a SIGTERM to the shell (a
# pod deleted, a job cancelled) reaches ddiloco, which then ends cleanly (a learner leaves,
# the syncer writes its summary); the shell exits with the command's status.
BASH_CHILD = """\
child=0
stopping=0
trap 'stopping=1; [ "$child" -gt 0 ] && kill -TERM "$child" 2>/dev/null' TERM INT
run_child() {
    "$@" &
    child=$!
    while :; do
        wait "$child"
        rc=$?
        kill -0 "$child" 2>/dev/null || break
    done
    child=0
    return "$rc"
}
"""


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")
_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./-]*")  # names and paths, written unquoted
_WORDS = ("y", "n", "yes", "no", "on", "off", "true", "false", "null")  # YAML 1.1 reads these


def to_yaml(value: Any, indent: int = 0) -> str:
    """YAML for dicts, lists, strings, ints and bools: strings always double-quoted (JSON
    escapes are YAML's) or, when they span lines, a literal block, so nothing is retyped."""
    return "".join(_yaml_lines(value, indent))


def yaml_documents(*docs: Any) -> str:
    return "".join("---\n" + to_yaml(d) for d in docs)


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return value if _PLAIN.fullmatch(value) and value.lower() not in _WORDS else _quote(value)
    raise TypeError(f"no YAML for {type(value).__name__}")


def _quote(text: str) -> str:
    """A double-quoted YAML string: JSON's escapes, and YAML's for what JSON leaves raw."""
    return "".join(
        c if c.isprintable() else f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}"
        for c in json.dumps(text, ensure_ascii=False)
    )


def _key(key: str) -> str:
    return key if _PLAIN_KEY.fullmatch(key) and key.lower() not in _WORDS else _quote(key)


def _block(text: str) -> bool:  # a literal block keeps a script readable, and exact
    lines = text.removesuffix("\n").split("\n")
    return (
        "\n" in text
        and not text.startswith((" ", "\n"))
        and not text.endswith("\n\n")
        and all(line == line.rstrip() and line.isprintable() for line in lines)
    )


def _yaml_lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            return [pad + "{}\n"]
        out: list[str] = []
        for key, item in value.items():
            out += _entry(pad + _key(str(key)) + ":", item, indent)
        return out
    if isinstance(value, list):
        if not value:
            return [pad + "[]\n"]
        out = []
        for item in value:
            if isinstance(item, dict) and item:
                inner = _yaml_lines(item, indent + 2)
                out += [pad + "- " + inner[0][indent + 2 :], *inner[1:]]
            else:
                out += _entry(pad + "-", item, indent)
        return out
    return [pad + _scalar(value) + "\n"]


def _entry(head: str, item: Any, indent: int) -> list[str]:
    if isinstance(item, dict | list) and item:
        return [head + "\n", *_yaml_lines(item, indent + 2)]
    if isinstance(item, dict | list):
        return [head + (" {}\n" if isinstance(item, dict) else " []\n")]
    if isinstance(item, str) and _block(item):
        chomp = "" if item.endswith("\n") else "-"  # keep the one final newline, or none
        pad = " " * (indent + 2)
        lines = item.removesuffix("\n").split("\n")
        return [f"{head} |{chomp}\n", *[(pad + line if line else "") + "\n" for line in lines]]
    return [head + " " + _scalar(item) + "\n"]
