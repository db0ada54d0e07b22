"""The kernel log for one attempt's time window: what only the kernel saw (I/O, bounded, never blocking).

A process killed by the OOM killer cannot say so, and a GPU that fell off the bus, an NVIDIA Xid or
an uncorrected PCIe error is written by the driver to the kernel log, not to the job's stderr. This
module reads that log once, at verdict time, for the attempt's window, and hands the relevant lines
to the diagnosis (`HostEvidence.kernel_lines`; what they mean is `judge/diagnosis/kernel.py`'s).

Sources, first readable wins: `/dev/kmsg` (non-blocking reads of the ring buffer; needs
CAP_SYSLOG or kernel.dmesg_restrict=0), `dmesg --time-format iso`, `journalctl -k` (members of
`adm`/`systemd-journal`), each subprocess with a timeout. Everything is bounded: bytes read, lines
kept, seconds spent. Nothing readable is said (`read=False`), never taken as "nothing happened".
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from supervisor.judge.diagnosis.kernel import KERNEL_OOM_RE, RELEVANT_RE

MAX_BYTES = 8 << 20  # of kernel log read at most
MAX_LINES = 200  # relevant lines kept (the newest)
TIMEOUT_S = 2.0  # per subprocess
# Sources that could not be read once are not tried again by this process (permissions do not come
# and go): a box where only journalctl works pays the failed dmesg once, not at every verdict.
_UNREADABLE: set[str] = set()
SLACK_S = 5.0  # clocks and buffering: the window is widened by this on both sides
_ISO_RE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:[+-]\d\d:?\d\d|Z)?)\s+(.*)$")


@dataclass(frozen=True)
class KernelLog:
    """Relevant kernel lines of a window, and whether the kernel log could be read at all."""

    lines: tuple[str, ...] = ()
    read: bool = False
    source: str = ""


def read_window(since: float, until: float | None = None, *, pids: Iterable[int] = (),
                cgroup: str | None = None) -> KernelLog:
    """Kernel log lines from [since, until] (wall-clock seconds) that may explain an attempt's end.

    OOM-killer lines are kept only when they name one of `pids` or the `cgroup` path: another job's
    kill is not this one's, and with neither there is nothing to tell them apart, so none is kept.
    Device lines (Xid, AER, amdgpu) are kept whatever process they name, since a faulty GPU fails
    every job on it.
    """
    until = time.time() if until is None else until
    lo, hi = since - SLACK_S, until + SLACK_S
    wanted = {int(p) for p in pids if p}
    for source, reader in (("/dev/kmsg", _kmsg), ("dmesg", _dmesg), ("journalctl", _journalctl)):
        if source in _UNREADABLE:
            continue
        records = reader(lo, hi)
        if records is None:
            _UNREADABLE.add(source)
            continue
        kept: deque[str] = deque(maxlen=MAX_LINES)
        for line in records:
            if RELEVANT_RE.search(line) and _ours(line, wanted, cgroup):
                kept.append(line.strip()[:2000])
        return KernelLog(tuple(kept), True, source)
    return KernelLog((), False, "")


def _ours(line: str, pids: set[int], cgroup: str | None) -> bool:
    if not KERNEL_OOM_RE.search(line):
        return True
    if cgroup and cgroup in line:
        return True
    return any(re.search(rf"(?:process |pid=){p}\b", line) for p in pids)


def _kmsg(lo: float, hi: float) -> list[str] | None:
    """Records of /dev/kmsg in [lo, hi], read without blocking; None when it cannot be opened."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    out: list[str] = []
    total = 0
    try:
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        while total < MAX_BYTES:
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # a record overwritten while we read: go on
                    continue
                if exc.errno == errno.EINVAL or total == 0:
                    return None if total == 0 else out
                break
            if not rec:
                break
            total += len(rec)
            head, _, msg = rec.decode("utf-8", "replace").partition(";")
            try:
                ts = boot + int(head.split(",")[2]) / 1e6
            except (IndexError, ValueError):
                continue
            if lo <= ts <= hi:
                out.append(msg.split("\n", 1)[0])  # continuation lines (" KEY=value") carry no text
    finally:
        os.close(fd)
    return out


def _run(argv: list[str]) -> str | None:
    try:
        res = subprocess.run(argv, capture_output=True, timeout=TIMEOUT_S, check=False,
                             env={**os.environ, "LC_ALL": "C", "SYSTEMD_PAGER": "", "PAGER": "cat"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    return res.stdout[:MAX_BYTES].decode("utf-8", "replace")


def _dmesg(lo: float, hi: float) -> list[str] | None:
    text = _run(["dmesg", "--time-format", "iso", "--nopager"])
    if text is None:
        return None
    return _iso_window(text, lo, hi)


def _journalctl(lo: float, hi: float) -> list[str] | None:
    text = _run(["journalctl", "-k", "-q", "--no-pager", "-o", "short-iso", "--since", f"@{int(lo)}",
                 "--until", f"@{int(hi) + 1}"])
    if text is None:
        return None
    # short-iso: "2024-04-05T21:29:39+0000 host kernel: msg"; the window was applied by journalctl.
    return [line.split(" kernel: ", 1)[-1] for line in text.splitlines()]


def _iso_window(text: str, lo: float, hi: float) -> list[str]:
    out = []
    for line in text.splitlines():
        m = _ISO_RE.match(line)
        if not m:
            continue
        try:
            ts = datetime.fromisoformat(m.group(1).replace(",", ".")).timestamp()
        except ValueError:
            continue
        if lo <= ts <= hi:
            out.append(m.group(2))
    return out
