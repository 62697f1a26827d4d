"""ddiloco.report."""
