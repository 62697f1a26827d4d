"""The wall-clock runtime: a syncer service and learner processes over authenticated TCP.

wire (frames), store (the syncer's durable state), syncer_service, link + learner_process
(+ ranks for torchrun learners), peer (recovery snapshots), proxy (wire faults), launcher
(``ddiloco train --runtime processes``). Every algorithm rule comes from ``ddiloco.core``.
"""
