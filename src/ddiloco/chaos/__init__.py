"""Chaos engineering: fault plans (events, generators, expansion) shared by both clocks."""
