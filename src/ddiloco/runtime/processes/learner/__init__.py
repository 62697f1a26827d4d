"""A learner process: its training loop around the core's step boundary, its link thread
to the syncer, peer snapshots for recovery, and torchrun ranks inside one learner."""
