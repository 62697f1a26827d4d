"""Runtimes that drive the pure core: a simulated clock (sim) and, later, real processes."""
