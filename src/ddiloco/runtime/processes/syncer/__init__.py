"""The syncer process: its service loop around the core's SyncerState, the checks of every
message's metadata, its durable store and journal, and its evaluator thread."""
