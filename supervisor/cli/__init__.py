"""The command line: `oom-supervisor ...` or `python -m supervisor.cli ...`."""

from supervisor.cli.main import main

__all__ = ["main"]
