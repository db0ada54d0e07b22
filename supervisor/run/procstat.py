"""/proc/PID/stat read the one safe way (stdlib only: the launch shim uses it too).

The command name (field 2) may hold spaces and parentheses, so the fields are split after the
LAST ')'. Fields are numbered as in proc(5): 3 is the state, 4 the parent, 22 the start time.
"""

from __future__ import annotations

import os


def stat_field(pid: int | str, number: int) -> int | None:
    """Numeric field `number` (>= 4) of /proc/PID/stat, or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[number - 3])
    except (OSError, ValueError, IndexError):
        return None


# What the kernel charges a process for: PSS divides every shared page (libraries mapped by a
# launcher and each rank, copy-on-write pages of forked DataLoader workers) among the processes
# that map it, so the sum over a tree counts each page once. RSS counts it in every process.
PSS = "proportional set size (/proc/PID/smaps_rollup: shared pages counted once)"
RSS = "resident set size (RSS: shared pages counted in every process)"


def charged_bytes(pid: int | str) -> tuple[int, str] | None:
    """(bytes, measure) of one process: its PSS, else (no smaps_rollup) its RSS; None when gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024, PSS
    except FileNotFoundError:
        pass  # a kernel before 4.14, or the process is gone: statm tells which
    except (OSError, ValueError, IndexError):
        return None
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE, RSS
    except (OSError, ValueError, IndexError):
        return None


def tree_charged_bytes(pids) -> tuple[int, str]:
    """The sum over processes, and the measure it is in (RSS as soon as one process lacked PSS)."""
    total, measure = 0, PSS
    for pid in pids:
        got = charged_bytes(pid)
        if got is not None:
            total += got[0]
            measure = measure if got[1] == PSS else RSS
    return total, measure


_PAGE = os.sysconf("SC_PAGE_SIZE")
