"""oom-supervisor: keeps unattended fine-tuning jobs alive through OOMs and crashes."""

from pathlib import Path

__version__ = "0.1.0"

# Where the package lies, named once: the shim is started with it on PYTHONPATH, the start-up
# hooks are injected from it, and a checkout's shipped policies/ sit beside it.
PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_ROOT = PACKAGE_DIR.parent
