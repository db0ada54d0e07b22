"""Test-only: a GPU-style OOM on chosen ranks of a CPU run, for the multi-rank night test.

The job's `env:` puts this folder on PYTHONPATH after the supervisor's start-up hook, whose
sitecustomize chains into this one in every process (torchrun's ranks included). When
`transformers.trainer` is imported, `Trainer.compute_loss` (the forward) raises PyTorch's own
`torch.OutOfMemoryError`, worded as the CUDA caching allocator words it, on the ranks in
OOMTEST_RANKS whenever the rank's micro-batch holds more than OOMTEST_MAX_TOKENS tokens: a smaller
micro-batch fits, as it would on a real GPU. With OOMTEST_OPTIMIZER_STEP=K and OOMTEST_ONCE=FILE, the
same error comes from inside the K-th `torch.optim.AdamW.step` of those ranks instead, after it
updated the parameters, once a night (FILE). The product contains nothing of this.

It also maps torch.load's `cpu:0` to `cpu` (transformers 5.6 resumes a multi-rank run's
optimizer.pt with map_location=args.device, which torch 2.14 cannot restore on CPU ranks; GPU
ranks are unaffected: see tests/hooks/plain_trainer.py).
"""

import importlib.util
import os
import sys

_MAX_TOKENS = int(os.environ.get("OOMTEST_MAX_TOKENS", "0") or 0)
_RANKS = {int(r) for r in os.environ.get("OOMTEST_RANKS", "").split(",") if r.strip()}
_RANK = int(os.environ.get("RANK", "-1"))
# An OOM inside the K-th optimizer step of the process, AFTER the parameters were updated (a
# half-updated state across the ranks), once per night: OOMTEST_ONCE names a file that, once written,
# disarms it (the remedied attempt runs the same steps again).
_OPTIMIZER_STEP = int(os.environ.get("OOMTEST_OPTIMIZER_STEP", "0") or 0)
_ONCE = os.environ.get("OOMTEST_ONCE", "")


def _oom_error(torch, need):
    return torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {need / 2**20:.2f} MiB. GPU {_RANK} has a total capacity "
        f"of 79.19 GiB of which {need / 2**21:.2f} MiB is free. Including non-PyTorch memory, this process "
        "has 78.96 GiB memory in use. Of the allocated memory 77.10 GiB is allocated by PyTorch, and "
        "1.21 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
        "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html"
        "#environment-variables)")


def _patch_trainer(module):
    import torch

    original = module.Trainer.compute_loss

    def compute_loss(self, model, inputs, *args, **kwargs):
        ids = inputs.get("input_ids") if hasattr(inputs, "get") else None  # a BatchEncoding, not a dict
        if _MAX_TOKENS and _RANK in _RANKS and ids is not None and ids.numel() > _MAX_TOKENS:
            need = ids.numel() * getattr(model, "module", model).config.vocab_size * 4  # the logits of this micro-batch, float32
            raise _oom_error(torch, need)
        return original(self, model, inputs, *args, **kwargs)

    module.Trainer.compute_loss = compute_loss
    if _OPTIMIZER_STEP and _RANK in _RANKS and _ONCE:
        _patch_optimizer(torch)


def _patch_optimizer(torch):
    step = torch.optim.AdamW.step
    calls = [0]

    def oom_step(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == _OPTIMIZER_STEP and not os.path.exists(_ONCE):
            with open(_ONCE, "w") as f:
                f.write(f"rank {_RANK}, optimizer step {calls[0]}\n")
            raise _oom_error(torch, sum(p.numel() for g in self.param_groups for p in g["params"]) * 8)
        return out

    torch.optim.AdamW.step = oom_step


def _patch_torch(torch):
    load = torch.load

    def cpu_load(*args, map_location=None, **kwargs):
        if isinstance(map_location, torch.device) and map_location.type == "cpu":
            map_location = "cpu"
        return load(*args, map_location=map_location, **kwargs)

    torch.load = cpu_load


_AFTER = {"transformers.trainer": _patch_trainer, "torch": _patch_torch}


class _Finder:
    """Runs _AFTER[name] once the watched module's body has executed."""

    def __init__(self):
        self.busy = set()

    def find_spec(self, name, path=None, target=None):
        if name not in _AFTER or name in self.busy:
            return None
        self.busy.add(name)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy.discard(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module):
            original(module)
            _AFTER.pop(name)(module)

        loader.exec_module = exec_module
        return spec


if _MAX_TOKENS or _OPTIMIZER_STEP or os.environ.get("OOMTEST_CPU_LOAD") == "1":
    sys.meta_path.insert(0, _Finder())
