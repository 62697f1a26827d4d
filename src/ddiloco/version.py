"""The package version (one place: the package, the command's --version)."""

__version__ = "0.1.0"
