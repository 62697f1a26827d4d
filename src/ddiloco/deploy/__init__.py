"""Job files for cluster schedulers, from one run config: ``ddiloco deploy ENGINE``.

One module per engine (SLURM, Kubernetes, KubeRay), each a pure function from the run config
and :class:`~ddiloco.deploy.common.DeployOptions` to ``{file name: text}``, so the tests
parse what a user would submit; ``ddiloco.commands.deploy`` writes the files.
"""

from __future__ import annotations

from ddiloco.config import RunConfig
from ddiloco.deploy import kuberay, kubernetes, slurm
from ddiloco.deploy.common import CONFIG_FILE, DeployOptions
from ddiloco.errors import require

ENGINES = ("slurm", "kubernetes", "kuberay")


def generate(
    engine: str, config: RunConfig, config_text: str, options: DeployOptions
) -> dict[str, str]:
    """Every file of ``engine``'s directory, the run config itself included (every process
    reads that one file)."""
    require(engine in ENGINES, "engine", engine, f"known: {', '.join(ENGINES)}")
    if engine == "slurm":
        files = slurm.generate(config, options)
    elif engine == "kubernetes":
        files = kubernetes.generate(config, config_text, options)
    else:
        files = kuberay.generate(config, config_text, options)
    return {CONFIG_FILE: config_text, **files}
