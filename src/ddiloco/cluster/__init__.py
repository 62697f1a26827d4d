"""ddiloco.cluster."""
