"""The loop and its record: store, attempts, recovery, configuration."""
