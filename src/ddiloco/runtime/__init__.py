"""Runtimes that drive the pure core: a simulated clock (sim) and real processes (processes)."""
