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
    r"|oom-kill:|oom_kill_process|oom_reaper: reaped process"
)
_XID_RE = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)\):\s*(?P<code>\d+)")
_XID_CAUSE_RE = re.compile(r"caused by previous Xid (\d+)")
_APP_XIDS = frozenset({13, 31, 32, 43, 45, 68, 69})
_AFTERMATH_XIDS = frozenset({43, 45})  # GPU stopped processing / preemptive cleanup: after a process ends
_ECC_XIDS = frozenset({48, 63, 64, 92, 94, 95, 140})
_OFF_BUS_RE = re.compile(r"fallen off the bus|GPU is lost")
_AER_RE = re.compile(r"AER: (?:Multiple )?Uncorrected \((?:Non-)?Fatal\) error|severity=Uncorrected")
_AMD_RE = re.compile(r"(?:amdgpu|\bdrmn\d+:).*?(?P<what>GPU reset begin|ring \S+ timeout|GPU recovery|"
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


# A kernel line as dmesg, `dmesg -T`, syslog or the journal print it, pasted into a log: the
# kernel's own shape (its timestamps, `host kernel:`, a driver's PCI device prefix) before a
# device-fault report. The same words anywhere else in a line (a program's message, a quote) are text.
_KERNEL_LEAD = (
    r"^(?:\[\s*\d+\.\d+\]\s*|\[\w{3} \w{3}\s+\d+ [\d:]{8} \d{4}\]\s*)?"
    # the journal's `-o cat`/`-k` forms may leave `kernel:` with no time or host before it
    r"(?:(?:(?:\w{3}\s+\d+ [\d:]{8}|\d{4}-\d\d-\d\dT\S+) \S+ )?kernel:\s*(?:\[\s*\d+\.\d+\]\s*)?)?"
)
_PCI = r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.\d"
_LOG_FAULT_RE = re.compile(
    _KERNEL_LEAD + r"(?:"
    # amdgpu's VM fault report (the GPU touched memory it may not), the IOMMU refusing the device's access
    rf"amdgpu {_PCI}: (?:amdgpu: )?(?P<page>\[\w+hub\d*\] (?:no-)?(?:retry )?page fault)"
    rf"|amdgpu {_PCI}: (?P<iommu>AMD-Vi: Event logged \[IO_PAGE_FAULT)"
    # a job that never finished on a ring, the reset that follows, or another amdgpu report kernel.py reads
    r"|(?P<ring>\[drm(?::| ERROR :)amdgpu_job_timedout\b.*\bring \S+ timeout)"
    rf"|amdgpu {_PCI}: (?:amdgpu: )?(?P<gcn>GPU fault detected)"
    rf"|(?P<dev>(?:[\w-]+ {_PCI}: |drmn\d+: ).*)"
    r"|(?P<nv>NVRM: .*)"
    r")"
)


def log_fault(text: str) -> KernelFault | None:
    """A device fault in a kernel line pasted into the job's log (its prefixes stripped), or None.
    Unlike the kernel window (device_faults), an application-class Xid counts (13, 31: the kernel's
    view of the fault a runtime calls an illegal memory access), but not 43/45 alone: the cleanup
    after any process that ended, killed or not."""
    if "amdgpu" not in text and "NVRM" not in text and "drm" not in text and "AER" not in text:
        return None
    m = _LOG_FAULT_RE.match(text)
    if m is None:
        return None
    if m.group("page") or m.group("gcn"):
        return KernelFault("gpu_page_fault", "hip", text[:2000])
    if m.group("iommu"):
        return KernelFault("iommu_page_fault", "hip", text[:2000])
    if m.group("ring"):
        return KernelFault("gpu_hang", "hip", text[:2000])
    found = device_faults([text])
    if found:
        return found[0]
    x = _XID_RE.search(text) if m.group("nv") else None
    if x is None:
        return None
    code = int(x.group("code"))
    cause = _XID_CAUSE_RE.search(text)
    if code in _AFTERMATH_XIDS and not (cause and int(cause.group(1)) not in _AFTERMATH_XIDS):
        return None  # a channel cleaned up after a process ended: what followed, not a fault
    return KernelFault("xid", "cuda", text[:2000], code)


def strongest(faults: list[KernelFault]) -> KernelFault | None:
    """The fault that explains most: a GPU off the bus, then ECC, then other Xids, AER, resets."""
    order = ("fallen_off_bus", "ecc_error", "xid", "pcie_aer", "gpu_hang")
    return min(faults, key=lambda f: order.index(f.subkind)) if faults else None
