"""Cluster-scale tools, independent of the training engine: numpy only, never torch.

- :mod:`~ddiloco.cluster.params`: the simulator's parameters (defaults: the paper set).
- :mod:`~ddiloco.cluster.failures`: failure traces of N chips, sampled in bulk.
- :mod:`~ddiloco.cluster.goodput`: non-elastic DP, elastic DP and Decoupled DiLoCo on a trace.
- :mod:`~ddiloco.cluster.table`: the goodput table over sizes and seeds, beside the paper's.
- :mod:`~ddiloco.cluster.plot`: its PNG. :mod:`~ddiloco.cluster.bandwidth`: the WAN planner.
"""

from ddiloco.cluster.params import ClusterParams, load_params
from ddiloco.cluster.table import TableResult, run_table

__all__ = ["ClusterParams", "TableResult", "load_params", "run_table"]
