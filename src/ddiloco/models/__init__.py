"""ddiloco.models."""
