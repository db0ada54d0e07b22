"""What kernel log lines say about an attempt's end (pure): OOM kills, GPU driver faults, PCIe errors.

The kernel sees what a dying process cannot print: the OOM killer, NVIDIA's Xid reports, a GPU that
fell off the bus, uncorrected PCIe (AER) errors, amdgpu resets. Lines come from the daemon's read
of the kernel log for the attempt's time window (supervisor/run/kernel_log.py) or from
`explain --kernel-log FILE`.

Xid codes that an application's own bug produces (13 graphics exception, 31 MMU fault, 43 stopped
processing, 45 channel cleanup after an earlier error, 68/69 engine errors, 32 push buffer) are not
a faulty device by themselves; a 45 "caused by previous Xid N" takes N's meaning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KERNEL_OOM_RE = re.compile(
    r"Out of memory: Kill(?:ed)? process (?P<pid>\d+)|Memory cgroup out of memory|invoked oom-killer"
    r"|oom-kill:|oom_kill_process"
)
_XID_RE = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)\):\s*(?P<code>\d+)")
_XID_CAUSE_RE = re.compile(r"caused by previous Xid (\d+)")
_APP_XIDS = frozenset({13, 31, 32, 43, 45, 68, 69})
_ECC_XIDS = frozenset({48, 63, 64, 92, 94, 95, 140})
_OFF_BUS_RE = re.compile(r"fallen off the bus|GPU is lost")
_AER_RE = re.compile(r"AER: (?:Multiple )?Uncorrected \((?:Non-)?Fatal\) error|severity=Uncorrected")
_AMD_RE = re.compile(r"amdgpu\b.*?(?P<what>GPU reset begin|ring \S+ timeout|GPU recovery|"
                     r"uncorrectable|RAS (?:poison|error)|GPU hang|Fatal error during GPU init)", re.IGNORECASE)
# Anything the daemon keeps for the diagnosis (the rest of the kernel log is not its business).
RELEVANT_RE = re.compile(
    KERNEL_OOM_RE.pattern + r"|NVRM:|\bXid\b|fallen off the bus|GPU is lost|AER:|PCIe Bus Error|amdgpu"
)


@dataclass(frozen=True)
class KernelFault:
    """A device fault the kernel reported."""

    subkind: str  # xid, fallen_off_bus, ecc_error, pcie_aer, gpu_hang
    vendor: str  # cuda | hip | unknown
    text: str
    code: int | None = None


def is_oom_line(line: str) -> bool:
    return KERNEL_OOM_RE.search(line) is not None


def device_faults(lines: tuple[str, ...] | list[str]) -> list[KernelFault]:
    """The kernel's device-fault lines, in order (application-class Xids left out)."""
    out: list[KernelFault] = []
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        m = _XID_RE.search(line)
        if m:
            code = int(m.group("code"))
            cause = _XID_CAUSE_RE.search(line)
            if code == 45 and cause:
                code = int(cause.group(1))
            if code in _APP_XIDS:
                continue
            sub = "fallen_off_bus" if code == 79 or _OFF_BUS_RE.search(line) else (
                "ecc_error" if code in _ECC_XIDS else "xid")
            out.append(KernelFault(sub, "cuda", line[:2000], code))
            continue
        if _OFF_BUS_RE.search(line):
            out.append(KernelFault("fallen_off_bus", "cuda" if "NVRM" in line or "NVIDIA" in line else "unknown",
                                   line[:2000]))
            continue
        if _AER_RE.search(line):
            out.append(KernelFault("pcie_aer", "unknown", line[:2000]))
            continue
        a = _AMD_RE.search(line)
        if a:
            what = a.group("what").lower()
            sub = "ecc_error" if ("uncorrectable" in what or "ras" in what) else "gpu_hang"
            out.append(KernelFault(sub, "hip", line[:2000]))
    return out


def strongest(faults: list[KernelFault]) -> KernelFault | None:
    """The fault that explains most: a GPU off the bus, then ECC, then other Xids, AER, resets."""
    order = ("fallen_off_bus", "ecc_error", "xid", "pcie_aer", "gpu_hang")
    return min(faults, key=lambda f: order.index(f.subkind)) if faults else None
