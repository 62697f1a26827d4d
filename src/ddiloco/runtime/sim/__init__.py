"""The simulated clock: learners and syncer in one process, real training, virtual time."""
