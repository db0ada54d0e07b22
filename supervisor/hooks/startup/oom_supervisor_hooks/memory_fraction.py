"""Cap PyTorch's GPU memory in every training process (OOM_SUPERVISOR_MEMORY_FRACTION).

  * runs after `import torch` only, in processes that import torch themselves;
  * never initialises CUDA: the cap is queued with torch.cuda._lazy_call, so it runs when the
    process itself first uses the GPU (a launcher that only counts devices gets no context);
  * caps the device this rank will use (LOCAL_RANK under torchrun, else 0), so no rank creates
    a context on a GPU it does not own.
For torch releases whose allocator reads `per_process_memory_fraction` from
PYTORCH_CUDA_ALLOC_CONF the supervisor uses that instead of this hook.
"""

import os

from . import TRACE_ENV, warn


def queue_cap(torch, fraction):
    def cap():
        try:
            count = torch.cuda.device_count()
            if count == 0:
                return
            local = int(os.environ.get("LOCAL_RANK", "0") or 0)
            device = local if 0 <= local < count else 0
            torch.cuda.set_per_process_memory_fraction(fraction, device)
        except Exception as exc:  # noqa: BLE001 - inside the user's training: never break it over the cap
            warn(f"could not set the memory fraction: {exc!r}")

    try:
        torch.cuda._lazy_call(cap)
        torch._oom_supervisor_memory_fraction = fraction  # for tests and debugging
    except Exception as exc:  # noqa: BLE001 - inside the user's training: never break it over the cap
        warn(f"could not queue the memory fraction: {exc!r}")
        return
    trace = os.environ.get(TRACE_ENV)
    if trace:  # one line per process that queued the cap (debugging, tests)
        try:
            with open(trace, "a") as fh:
                fh.write(f"{os.getpid()} local_rank={os.environ.get('LOCAL_RANK', '-')} fraction={fraction}\n")
        except OSError:
            pass
