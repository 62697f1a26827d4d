"""The pure core: fragment plans, merge rules, outer optimizers, codecs, round policy, ledger.

Nothing in this package performs I/O, reads a clock or touches global random state: time
and randomness arrive as arguments, so the simulated-clock and real-process runtimes drive
exactly the same rules.
"""
