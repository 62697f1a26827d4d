"""ddiloco.chaos."""
