"""ddiloco.runtime."""
