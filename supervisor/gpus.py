"""GPU memory capacity, for the policy's fit predictions. Never trusted to answer.

Monitoring tools can hang on a stuck driver (nvidia-smi, amd-smi): every probe
runs with a timeout, and no answer means "unknown" (the policy then uses the
capacity printed in the OOM message itself). AMD's sysfs files need no tool.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

PROBE_TIMEOUT_S = 10.0


def _nvidia(timeout: float) -> dict[int, int]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=timeout, check=True).stdout
    caps = {}
    for line in out.splitlines():
        idx, mib = (x.strip() for x in line.split(","))
        caps[int(idx)] = int(float(mib)) * (1 << 20)
    return caps


def _amd_sysfs(root: Path) -> dict[int, int]:
    caps, idx = {}, 0
    for card in sorted(root.glob("card[0-9]*"), key=lambda p: int(p.name[4:]) if p.name[4:].isdigit() else 1 << 30):
        f = card / "device" / "mem_info_vram_total"
        if f.exists():
            caps[idx] = int(f.read_text().strip())
            idx += 1
    return caps


def _rocm_smi(timeout: float) -> dict[int, int]:
    out = subprocess.run(["rocm-smi", "--showmeminfo", "vram", "--json"], capture_output=True, text=True,
                         timeout=timeout, check=True).stdout
    caps = {}
    for key, val in json.loads(out).items():
        if key.startswith("card") and isinstance(val, dict):
            total = next((v for k, v in val.items() if "Total Memory" in k), None)
            if total is not None:
                caps[int(key[4:])] = int(total)
    return caps


def probe_capacities(*, timeout: float = PROBE_TIMEOUT_S, drm_root: Path = Path("/sys/class/drm")) -> dict[int, int]:
    """{device index: bytes} from the first source that answers; {} when none does."""
    try:
        caps = _amd_sysfs(drm_root)
        if caps:
            return caps
    except (OSError, ValueError):
        pass
    for probe in (_nvidia, _rocm_smi):
        try:
            caps = probe(timeout)
            if caps:
                return caps
        except (OSError, subprocess.SubprocessError, ValueError, KeyError):
            continue
    return {}


def capacity_for(caps: dict[int, int], gpus: list[int] | None) -> int | None:
    """The smallest capacity among the job's GPUs (all of them when unspecified)."""
    chosen = [caps[g] for g in (gpus if gpus is not None else caps) if g in caps]
    return min(chosen) if chosen else None
