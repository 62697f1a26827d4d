"""The wall-clock runtime: a syncer service and learner processes over authenticated TCP.

By concern: ``transport`` (frames, authentication, shared memory, the fault proxy, events,
snapshots), ``syncer`` (the service around the core's SyncerState, its store, its evaluator),
``learner`` (the training loop around the core's step boundary, its link thread, peer
recovery, torchrun ranks), ``launcher`` (supervision: ``ddiloco train --runtime processes``
for fragment methods and the torchrun data-parallel job). Every algorithm rule comes from
``ddiloco.core``; the run's parts from :mod:`ddiloco.runtime.run`.
"""
