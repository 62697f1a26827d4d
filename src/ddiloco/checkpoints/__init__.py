"""Checkpoints of the global model: the directory a user takes home from any run.

:mod:`.format` (the files, names and layout), :mod:`.write` (the writer both clocks use),
:mod:`.load` (find, check, load), :mod:`.sim_state` (the simulated clock's resume state),
:mod:`.recover` (the model of a processes run from its syncer store or rollback checkpoints,
when it stopped before its last checkpoint).
"""

from ddiloco.checkpoints.format import CheckpointError as CheckpointError
