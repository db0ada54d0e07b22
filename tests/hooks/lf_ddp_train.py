"""LLaMA-Factory's own training entry (`run_exp`, what `llamafactory-cli train` runs on each rank
under FORCE_TORCHRUN) for the hook's multi-rank tests, plus a real CPU-allocator OOM injected in
the C-th training forward call of rank R: run as `torchrun ... lf_ddp_train.py JOB.yaml C R`.
"""

import os
import sys

import torch
from llamafactory.train.tuner import run_exp
from transformers import TrainerCallback

job, oom_forward, oom_rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
RANK = int(os.environ.get("RANK", "0"))

# transformers 5.6 resumes a multi-rank run's optimizer.pt with map_location=args.device, `cpu:0`
# on CPU ranks, which torch 2.14 cannot restore (see plain_trainer.py); GPU ranks are unaffected.
_load = torch.load


def load(*args, map_location=None, **kwargs):
    if isinstance(map_location, torch.device) and map_location.type == "cpu":
        map_location = "cpu"
    return _load(*args, map_location=map_location, **kwargs)


torch.load = load


class OOMInForward(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kw):
        forward, calls = model.forward, [0]

        def counted(*a, **k):
            if model.training:
                calls[0] += 1
                if oom_rank == RANK and calls[0] == oom_forward:
                    torch.empty(1 << 50, dtype=torch.uint8)  # DefaultCPUAllocator: can't allocate memory
            return forward(*a, **k)

        model.forward = counted


sys.argv = [sys.argv[0], job]  # run_exp reads the YAML path from argv
run_exp(callbacks=[OOMInForward()] if oom_forward else [])
if torch.distributed.is_initialized():  # see plain_trainer.py: gloo's teardown may abort a finished rank
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
