"""/proc/PID/stat read the one safe way (stdlib only: the launch shim uses it too).

The command name (field 2) may hold spaces and parentheses, so the fields are split after the
LAST ')'. Fields are numbered as in proc(5): 3 is the state, 4 the parent, 22 the start time.
"""

from __future__ import annotations


def stat_field(pid: int | str, number: int) -> int | None:
    """Numeric field `number` (>= 4) of /proc/PID/stat, or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[number - 3])
    except (OSError, ValueError, IndexError):
        return None
