"""ddiloco.strategies."""
