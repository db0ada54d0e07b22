"""Telling a full disk from other failures, and saying which folder is full.

SQLite says "database or disk is full" (SQLITE_FULL), file writes raise ENOSPC
or EDQUOT. When the state folder is full the daemon keeps following its
attempts, starts nothing new, and writes again once space returns; the
message names the folder and what statvfs says about it.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path


def is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if isinstance(exc, sqlite3.OperationalError):
        text = str(exc).lower()
        return "database or disk is full" in text or "disk i/o error" in text
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_disk_full(cause)


def free_bytes(folder: Path) -> int | None:
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def describe_full(folder: Path, exc: BaseException) -> str:
    free = free_bytes(folder)
    room = f"{free / (1 << 20):.1f} MiB free" if free is not None else "free space unknown"
    return f"the state folder {folder} is full ({room}; {exc}); not starting attempts until it has room"
