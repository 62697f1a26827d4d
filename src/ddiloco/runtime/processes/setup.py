"""The syncer's restart-tolerant ledger (moving to the core)."""

# transient, until the launcher accepts every fragment method by itself
PROCESS_METHODS = ("decoupled", "decoupled_sync", "streaming", "diloco")
