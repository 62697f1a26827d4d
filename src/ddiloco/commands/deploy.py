"""``ddiloco deploy slurm|kubernetes|kuberay``: write a run's job files into a directory.

The generators (:mod:`ddiloco.deploy`) are pure; this writes their files, copies the run
config in (the resolved one when ``--set`` changed it), and makes the run secret
(``run.secret``, mode 0600) unless ``--secret-file`` names one (not for kuberay: the Ray
runtime makes its own). Each directory's README.md
has the commands to launch, watch and stop the run.
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from ddiloco.commands import add_config_arguments
from ddiloco.config import load_config, to_toml
from ddiloco.deploy import ENGINES, generate
from ddiloco.deploy.common import SECRET_FILE, DeployOptions
from ddiloco.errors import ConfigError, require
from ddiloco.runtime.processes.transport.sockets import load_secret

# the options only some engines use: given to another, they are refused (a typo'd engine)
ONLY = {
    "syncer_host": ("slurm",),
    "partition": ("slurm",),
    "syncer_partition": ("slurm",),
    "account": ("slurm",),
    "time": ("slurm",),
    "cpus_per_learner": ("slurm",),
    "env_setup": ("slurm",),
    "sbatch_extra": ("slurm",),
    "store": ("slurm", "kubernetes"),
    "secret_file": ("slurm", "kubernetes"),
    "nodes_per_learner": ("slurm",),
    "image": ("kubernetes", "kuberay"),
    "namespace": ("kubernetes", "kuberay"),
    "storage": ("kubernetes",),
    "storage_class": ("kubernetes",),
    "ray_version": ("kuberay",),
}
OPTIONAL = (  # DeployOptions fields taken from the flag of the same name when it is given
    "method",
    "port",
    "peer_port",
    "gpus_per_learner",
    "syncer_cpus",
    *ONLY,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("engine", choices=ENGINES, help="the scheduler to write job files for")
    add_config_arguments(parser, "the run's TOML config (required; copied into --out)")
    parser.add_argument("--out", required=True, help="the directory to write (created)")
    parser.add_argument("--run-id", help="the run's id, bound into every frame (default: name)")
    parser.add_argument("--method", help="the fragment method to run (default: decoupled)")
    parser.add_argument("--port", type=int, help="the syncer's port (default: processes.bind's)")
    parser.add_argument(
        "--peer-port", type=int, help="learners' recovery port (default: processes.peer_port)"
    )
    parser.add_argument("--store", help="the syncer's state directory (slurm, kubernetes)")
    parser.add_argument(
        "--secret-file", help="an existing run secret (default: a new run.secret; not kuberay)"
    )
    parser.add_argument(
        "--gpus-per-learner", type=int, help="GPUs per learner (default: train.gpus_per_learner)"
    )
    parser.add_argument("--syncer-cpus", type=int, help="the syncer's CPUs (default: 2)")
    slurm = parser.add_argument_group("slurm")
    slurm.add_argument("--nodes-per-learner", type=int, help="nodes of one learner (default: 1)")
    slurm.add_argument("--syncer-host", help="pin the syncer job to this node (default: any)")
    slurm.add_argument("--partition", help="the learners' partition (and the syncer's)")
    slurm.add_argument("--syncer-partition", help="the syncer's partition (default: --partition)")
    slurm.add_argument("--account", help="the account jobs are charged to")
    slurm.add_argument("--time", help="every job's time limit, e.g. 2-00:00:00")
    slurm.add_argument("--cpus-per-learner", type=int, help="CPUs on each node of a learner")
    slurm.add_argument("--env-setup", help="a shell line every job runs first, e.g. 'source ...'")
    slurm.add_argument(
        "--sbatch",
        dest="sbatch_extra",
        action="append",
        metavar="OPTION",
        help="one more #SBATCH option for every job, e.g. --sbatch=--mem=64G (repeatable)",
    )
    k8s = parser.add_argument_group("kubernetes, kuberay")
    k8s.add_argument("--image", help="the container image (ddiloco installed; required)")
    k8s.add_argument("--namespace", help="the namespace (default: default)")
    k8s.add_argument("--storage", help="the syncer's volume size (default: 10Gi)")
    k8s.add_argument("--storage-class", help="the syncer volume's storage class")
    k8s.add_argument("--ray-version", help="kuberay: the image's Ray version (spec.rayVersion)")


def options_from(args: argparse.Namespace, run_id: str, home: Path) -> DeployOptions:
    given = {name: getattr(args, name) for name in OPTIONAL if getattr(args, name) is not None}
    for name, engines in ONLY.items():
        flag = "--" + ("sbatch" if name == "sbatch_extra" else name.replace("_", "-"))
        require(
            name not in given or args.engine in engines,
            flag,
            given.get(name),
            f"is for {', '.join(engines)}, not {args.engine}",
        )
    if "sbatch_extra" in given:
        given["sbatch_extra"] = tuple(given["sbatch_extra"])
    if "secret_file" in given:
        given["secret_file"] = str(Path(given["secret_file"]).resolve())
    return DeployOptions(run_id=run_id, home=str(home), **given)


def run(args: argparse.Namespace) -> int:
    if not args.config:
        raise ConfigError("--config", None, "name the run's TOML config: --config run.toml")
    config = load_config(args.config, list(args.set))
    try:
        text = Path(args.config).read_text()
    except OSError as exc:
        raise ConfigError("--config", args.config, f"cannot read: {exc}") from None
    if args.set:  # what every process must read is the config with the overrides
        text = f"# {args.config} with --set {' '.join(args.set)}\n" + to_toml(config)
    out = Path(args.out).resolve()
    options = options_from(args, args.run_id or config.name, out)
    files = generate(args.engine, config, text, options)
    if options.secret_file:
        load_secret(options.secret_file)  # readable, private, long enough: or refused here
    # the Ray runtime's launcher makes its secret itself
    write(out, files, args.engine, new_secret=not options.secret_file and args.engine != "kuberay")
    print(f"wrote {len(files)} files to {out}: see {out / 'README.md'}")
    return 0


def write(out: Path, files: dict[str, str], engine: str, new_secret: bool = True) -> None:
    """The files (scripts executable), the directories jobs write to, and ``run.secret``
    when none is there (an existing one is kept: running jobs hold it)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = out / name
        path.write_text(text)
        path.chmod(0o755 if name.endswith((".sh", ".sbatch")) else 0o644)
    if engine == "slurm":
        for sub in ("logs", "state"):
            (out / sub).mkdir(exist_ok=True)
    secret = out / SECRET_FILE
    if not new_secret:
        return
    if not secret.exists():
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    load_secret(str(secret))
