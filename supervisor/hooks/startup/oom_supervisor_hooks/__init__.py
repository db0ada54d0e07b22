"""The start-up hook's features, switched on by environment variables (see sitecustomize.py).

Standard library only at import time: this runs in every Python process of an attempt, most of
which (launchers, data workers, compilers) never train.
"""

import os
import sys

MEMORY_FRACTION_ENV = "OOM_SUPERVISOR_MEMORY_FRACTION"
EMERGENCY_ENV = "OOM_SUPERVISOR_EMERGENCY_CKPT"
PEAK_FILE_ENV = "OOM_SUPERVISOR_PEAK_FILE"
TRACE_ENV = "OOM_SUPERVISOR_HOOK_TRACE"


def warn(msg):
    sys.stderr.write(f"[oom-supervisor hook] {msg}\n")


def install():
    from . import _imports

    fraction = _fraction()
    if fraction is not None:
        from . import memory_fraction

        _imports.after_import("torch", lambda torch: memory_fraction.queue_cap(torch, fraction))
    if os.environ.get(PEAK_FILE_ENV):
        from . import peak

        _imports.after_import("torch", peak.install)
    if _emergency_on():
        from . import emergency

        _imports.after_import("transformers.trainer", emergency.install)
    if os.environ.get("OOM_SUPERVISOR_DS_UNIVERSAL_FIX") == "1":
        from . import ds_universal

        _imports.after_import("deepspeed.runtime.zero.stage3", ds_universal.install)


def _fraction():
    raw = os.environ.get(MEMORY_FRACTION_ENV)
    if not raw:
        return None
    try:
        fraction = float(raw)
        if not 0.0 < fraction <= 1.0:
            raise ValueError
    except ValueError:
        warn(f"{MEMORY_FRACTION_ENV}={raw!r} is not a fraction in (0, 1]; no cap")
        return None
    return fraction


def _emergency_on():
    raw = os.environ.get(EMERGENCY_ENV, "").strip()
    if raw in ("", "0"):
        return False
    if raw == "1":
        return True
    warn(f"{EMERGENCY_ENV}={raw!r} is neither 1 (on) nor 0 (off); emergency checkpoint off")
    return False
