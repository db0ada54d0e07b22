"""Cap PyTorch's GPU memory in every training process, without touching others.

Put this folder first on PYTHONPATH and set OOM_SUPERVISOR_MEMORY_FRACTION
(e.g. 0.88). Python imports `sitecustomize` at start-up in every process,
torchrun ranks included. The hook:
  * imports nothing heavy: it watches for `import torch` (a meta-path finder)
    and acts only in processes that import torch themselves;
  * never initialises CUDA: it queues the cap with torch.cuda._lazy_call, so
    it runs when the process itself first uses the GPU (a launcher that only
    counts devices never gets a CUDA context);
  * caps the device this rank will use (LOCAL_RANK under torchrun, else 0),
    so no rank creates a context on a GPU it does not own;
  * then runs any other sitecustomize further down the path.
For torch releases whose allocator reads `per_process_memory_fraction` from
PYTORCH_CUDA_ALLOC_CONF the supervisor uses that instead of this hook.
"""

import importlib.util
import os
import sys

ENV = "OOM_SUPERVISOR_MEMORY_FRACTION"
TRACE_ENV = "OOM_SUPERVISOR_HOOK_TRACE"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _warn(msg):
    sys.stderr.write(f"[oom-supervisor hook] {msg}\n")


def _queue_cap(torch, fraction):
    def cap():
        try:
            count = torch.cuda.device_count()
            if count == 0:
                return
            local = int(os.environ.get("LOCAL_RANK", "0") or 0)
            device = local if 0 <= local < count else 0
            torch.cuda.set_per_process_memory_fraction(fraction, device)
        except Exception as exc:  # never break the training over the cap
            _warn(f"could not set the memory fraction: {exc!r}")

    try:
        torch.cuda._lazy_call(cap)
        torch._oom_supervisor_memory_fraction = fraction  # for tests and debugging
    except Exception as exc:
        _warn(f"could not queue the memory fraction: {exc!r}")
        return
    trace = os.environ.get(TRACE_ENV)
    if trace:  # one line per process that queued the cap (debugging, tests)
        try:
            with open(trace, "a") as fh:
                fh.write(f"{os.getpid()} local_rank={os.environ.get('LOCAL_RANK', '-')} fraction={fraction}\n")
        except OSError:
            pass


class _TorchWatcher:
    """Finds `torch` like everyone else, then runs the cap queueing after its import."""

    def __init__(self, fraction):
        self.fraction = fraction

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module
        fraction = self.fraction

        def exec_module(module):
            original(module)
            _queue_cap(module, fraction)

        spec.loader.exec_module = exec_module
        return spec


def _install():
    raw = os.environ.get(ENV)
    if not raw:
        return
    try:
        fraction = float(raw)
        if not 0.0 < fraction <= 1.0:
            raise ValueError
    except ValueError:
        _warn(f"{ENV}={raw!r} is not a fraction in (0, 1]; no cap")
        return
    if "torch" in sys.modules:
        _queue_cap(sys.modules["torch"], fraction)
    else:
        sys.meta_path.insert(0, _TorchWatcher(fraction))


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
    except Exception as exc:
        _warn(f"the chained sitecustomize failed: {exc!r}")
    finally:
        sys.path[:] = saved
        if chained is None and me is not None:
            sys.modules["sitecustomize"] = me


_install()
_chain()
