"""How many ranks `llamafactory-cli train` really launches, without importing torch.

LLaMA-Factory 0.9.5 (`launcher.py`) runs torchrun when FORCE_TORCHRUN is set or more than one
device is visible, with `--nproc_per_node` = NPROC_PER_NODE or torch's device count; torch counts
only the devices CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES leave visible.
The policy needs that number (JobContext.nproc_per_node / gpus / visible_gpu_count) so that no
remedy changes the world size. Pure: the caller passes the environment and the probed count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def visible_gpu_count(env: Mapping[str, str], probed: int) -> int:
    """GPUs a process started with `env` sees, of the `probed` ones on the box.

    An empty variable hides every device; the CUDA runtime stops at the first invalid entry
    (e.g. "-1"), so "0,-1,2" shows one.
    """
    count = probed
    for name in VISIBILITY_VARS:
        if name not in env:
            continue
        ids = 0
        for part in env[name].split(","):
            part = part.strip()
            if not part or part.startswith("-"):
                break
            ids += 1
        count = min(count, ids)
    return max(0, count)


def pinned_nproc(env: Mapping[str, str]) -> int | None:
    """NPROC_PER_NODE the job's own environment sets (a positive integer), else None."""
    try:
        n = int(str(env.get("NPROC_PER_NODE", "")).strip())
    except ValueError:
        return None
    return n if n > 0 else None


def launch_fields(*, nproc_per_node: int | None, gpus: Sequence[int] | None, env: Mapping[str, str],
                  probed_gpus: int) -> dict[str, Any]:
    """JobContext keyword arguments for the world size the launch really has:
    `JobContext(..., **launch_fields(nproc_per_node=spec.sup.nproc_per_node, gpus=spec.sup.gpus,
    env=<the attempt's environment>, probed_gpus=len(probe_capacities())))`."""
    return {"nproc_per_node": nproc_per_node or pinned_nproc(env),
            "gpus": tuple(gpus) if gpus else None,
            "visible_gpu_count": visible_gpu_count(env, probed_gpus)}


def visibility_env(gpus: Sequence[int], vendor: str) -> dict[str, str]:
    """The variables that restrict a process to `gpus`, as its vendor reads them.

    ROCm filters in layers (ROCR_VISIBLE_DEVICES first, then HIP_VISIBLE_DEVICES indexes
    into what is left), so AMD gets ROCR only and the others are removed by the caller;
    NVIDIA reads CUDA_VISIBLE_DEVICES; unknown gets CUDA and HIP with the same list (HIP
    also honours CUDA_VISIBLE_DEVICES), as before.
    """
    ids = ",".join(str(g) for g in gpus)
    if vendor == "amd":
        return {"ROCR_VISIBLE_DEVICES": ids}
    if vendor == "nvidia":
        return {"CUDA_VISIBLE_DEVICES": ids}
    return {"CUDA_VISIBLE_DEVICES": ids, "HIP_VISIBLE_DEVICES": ids}
