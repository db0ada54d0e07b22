"""Before a resume: can the checkpoint's optimizer state be loaded at all? Pure.

What loading holds, read in the source (transformers 5.6 `Trainer._load_optimizer_and_scheduler`,
DeepSpeed 0.19.8 `DeepSpeedEngine._load_zero_checkpoint`):

* no DeepSpeed, one rank: `torch.load(optimizer.pt, map_location="cpu")`: the whole optimizer
  state is in host memory before it moves to the device ("to avoid OOM for GPU RAM").
* no DeepSpeed, several ranks: every rank loads the whole file onto its own device
  (`map_location=args.device`): each GPU holds all of it, as in training (DDP keeps the full
  optimizer state on every rank); on CPU ranks (gloo) that is one whole copy per rank in host RAM.
* DeepSpeed ZeRO: every rank loads its own shard (`zero_pp_rank_<r>_mp_rank_00_optim_states.pt`,
  `map_location="cpu"`), all ranks at once; with optimizer offload the states already sit in host
  memory at that moment, so the shard being loaded comes on top of them.
* a universal checkpoint is read per parameter (small files, one at a time), but DeepSpeed's
  ZeRO-3 universal loader first loads `zero/optimizer_state.pt` on EVERY rank: the old rank 0's
  whole optimizer file (measured: the load-time host OOM of tests/checkpoints/test_real_load_oom.py).
  Slimmed (`universal_load`), it is a few KiB.

The sizes are the files' sizes on disk, a slight overestimate of the tensors in them (a pickle
and zip headers). A resume is refused only when even the smallest amount that loading must hold
exceeds a hard bound (the job's host_memory_limit, else the box's RAM): that cannot load on this
box, whatever else runs. Above the softer budget (less the reserve and what others hold now) or
a GPU's capacity it is said, not refused: memory others hold means wait, and the policy answers
an OOM at load time with load-time remedies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from supervisor.judge.resume import Checkpoint

GiB = 1 << 30
HEADER_ALLOWANCE = 1 << 20  # per file: what of its size may be pickle and zip framing, not tensors


@dataclass(frozen=True)
class LoadCheck:
    refuse: str | None = None
    note: str | None = None
    numbers: dict[str, Any] = field(default_factory=dict)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def check_load(ckpt: Checkpoint | None, *, mode: str, world: int, offload_optimizer: bool,
               host_limit: int | None, host_ram: int | None, host_budget: int | None,
               gpu_capacity: int | None, lean: bool = False) -> LoadCheck:
    """`mode`: the resume plan's mode (`exact`: the state as saved; `universal`: converted first);
    `gpu_capacity`: per GPU, None on a box without GPUs (then every rank loads into host RAM);
    `lean`: a universal load without the old rank 0's optimizer file."""
    if ckpt is None or mode not in ("exact", "universal") or not ckpt.optimizer_bytes \
            or not ckpt.largest_optimizer_file or (mode == "universal" and (lean or ckpt.zero_stage != 3)):
        return LoadCheck()
    total, largest = ckpt.optimizer_bytes, ckpt.largest_optimizer_file
    files = max(1, round(total / largest))
    on_gpu = gpu_capacity is not None
    if mode == "universal":
        # rank 0's shard is the largest or as large as any (ZeRO pads partitions evenly)
        host_floor = largest - HEADER_ALLOWANCE
        how = (f"DeepSpeed's universal loader makes each of the {world} ranks hold the old rank 0's whole optimizer "
               f"file ({_gib(largest)}) while it loads")
        gpu_need = None
    elif not ckpt.deepspeed:
        if world > 1 and on_gpu:
            host_floor, how = 0, "each rank loads the whole optimizer.pt onto its own GPU"
        elif world > 1:
            host_floor, how = world * (total - HEADER_ALLOWANCE), (f"each of the {world} CPU ranks loads the "
                                                                   "whole optimizer.pt into host memory")
        else:
            host_floor, how = total - HEADER_ALLOWANCE, ("transformers loads the whole optimizer.pt into host "
                                                         "memory (map_location='cpu') before it moves to the device")
        gpu_need = total if on_gpu else None
    else:
        host_floor = largest - HEADER_ALLOWANCE
        how = f"every rank loads its own ZeRO shard into host memory (largest {_gib(largest)} of {files})"
        if offload_optimizer:
            host_floor = total + largest - (files + 1) * HEADER_ALLOWANCE
            how += ", on top of the optimizer state that offload already holds there"
        gpu_need = None if offload_optimizer or not on_gpu else largest
    host_floor = max(0, host_floor)
    hard = host_limit or host_ram
    hard_words = (f"the job's host_memory_limit of {_gib(host_limit)}" if host_limit
                  else f"the box's {_gib(host_ram)} of RAM" if host_ram else None)
    numbers = {"optimizer_bytes": total, "largest_file_bytes": largest, "host_need_bytes": host_floor,
               "host_bound_bytes": hard, "host_budget_bytes": host_budget, "gpu_need_bytes": gpu_need,
               "gpu_capacity_bytes": gpu_capacity}
    head = f"{ckpt.path.name}'s optimizer state is {_gib(total)} on disk; {how}: at least {_gib(host_floor)}"
    if hard and host_floor > hard:
        return LoadCheck(refuse=(f"{head}, more than {hard_words}: it cannot be loaded on this box. Give the job "
                                 "more host memory, or run it where there is more"), numbers=numbers)
    said = []
    if mode == "universal" and host_budget is not None and world * host_floor > host_budget:
        said.append(f"{head} a rank, {_gib(world * host_floor)} for all {world}, more than the ~{_gib(host_budget)} "
                    "the job may use now: if the load runs out of host memory, the policy loads it lean "
                    "(universal_load)")
    elif host_budget is not None and host_floor > host_budget:
        said.append(f"{head}, more than the ~{_gib(host_budget)} the job may use now: the load may run out of "
                    "host memory (answered with load-time remedies if it does)")
    if gpu_need is not None and gpu_capacity and gpu_need > gpu_capacity:
        said.append(f"{head.split(';')[0]}; each GPU must hold {_gib(gpu_need)} of it, more than its "
                    f"{_gib(gpu_capacity)}: it cannot load without ZeRO offload of the optimizer")
    return LoadCheck(note="; ".join(said) or None, numbers=numbers)
