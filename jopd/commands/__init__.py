"""CLI commands, one module each (discovered by `jopd.cli`)."""
