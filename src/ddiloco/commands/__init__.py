"""One module per ``ddiloco`` subcommand: each adds its arguments and runs."""
