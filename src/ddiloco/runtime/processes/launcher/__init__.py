"""Supervising a run's processes on one host: the shared supervisor, pre-flight checks,
restart policy, the fragment-method launcher and the torchrun data-parallel job."""
