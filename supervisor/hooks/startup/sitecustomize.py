"""oom-supervisor's start-up hook for training processes (one folder, several features).

The supervisor puts this folder first on PYTHONPATH; Python imports `sitecustomize` at start-up
in every process, torchrun ranks included. Each feature is switched on by its own variable and
costs nothing when off:

  OOM_SUPERVISOR_MEMORY_FRACTION=0.88   cap PyTorch's GPU memory of this rank (memory_fraction.py)
  OOM_SUPERVISOR_EMERGENCY_CKPT=1       on a catchable OOM in a transformers Trainer run (one
                                        process, or a DDP replica), save a complete checkpoint of
                                        the last finished step before exiting (emergency.py,
                                        replica.py); OOM_SUPERVISOR_EMERGENCY_BUDGET_S bounds a
                                        replica's save (default 300 s)
  OOM_SUPERVISOR_PEAK_FILE=PATH         record peak GPU memory per device into PATH (JSON) at exit
                                        and on the OOM path (peak.py)
  OOM_SUPERVISOR_DS_UNIVERSAL_FIX=1     correct DeepSpeed's ZeRO-3 universal checkpoint load (a
                                        shared Adam step counter, group 0's weight decay everywhere)
                                        (ds_universal.py)

Nothing heavy is imported here: the features watch for `import torch` / `transformers.trainer`
and act only in processes that import those themselves. Then any other sitecustomize further
down the path runs (this one shadows it).
"""

import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _install():
    try:
        from oom_supervisor_hooks import install
    except Exception as exc:  # noqa: BLE001 - inside the user's training: never break it over the hook
        sys.stderr.write(f"[oom-supervisor hook] could not load the hooks: {exc!r}\n")
        return
    install()


def _chain():
    """Run the sitecustomize this one shadows, if any."""
    me = sys.modules.get("sitecustomize")
    saved = list(sys.path)
    chained = None
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
        sys.modules.pop("sitecustomize", None)
        spec = importlib.util.find_spec("sitecustomize")
        if spec is not None and spec.loader is not None and spec.origin != __file__:
            chained = importlib.util.module_from_spec(spec)
            sys.modules["sitecustomize"] = chained
            spec.loader.exec_module(chained)
    except Exception as exc:  # noqa: BLE001 - the user's own sitecustomize failing is theirs to see, not ours to raise
        sys.stderr.write(f"[oom-supervisor hook] the chained sitecustomize failed: {exc!r}\n")
    finally:
        sys.path[:] = saved
        if chained is None and me is not None:
            sys.modules["sitecustomize"] = me


if any(os.environ.get(v) for v in ("OOM_SUPERVISOR_MEMORY_FRACTION", "OOM_SUPERVISOR_EMERGENCY_CKPT",
                                   "OOM_SUPERVISOR_PEAK_FILE", "OOM_SUPERVISOR_DS_UNIVERSAL_FIX")):
    _install()
_chain()
