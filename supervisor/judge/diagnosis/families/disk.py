"""A disk or quota filled up, or a checkpoint writer failed the way a full disk makes it fail."""

from __future__ import annotations

import re

from supervisor.core.models import Category
from supervisor.judge.diagnosis.hits import ROOT, Hit, Segment

# --- disk -----------------------------------------------------------------
_DISK_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("no_space", re.compile(r"[Nn]o space left on device|\[Errno 28\]|\bENOSPC\b|os error 28|StorageFull"
                            # Go's syscall text (docker, containerd) is lower-case; HF datasets' builder.py checks
                            # the room before it writes; Windows' ERROR_DISK_FULL (WinError 112)
                            r"|Not enough disk space\. Needed:|\[WinError 112\]|not enough space on the disk"
                            # TF maps ENOSPC/EDQUOT on a write to RESOURCE_EXHAUSTED (platform/errors.cc
                            # IOError); its saver writes a bundle to a `<prefix>.tempstate<N>` file
                            r"|(?:ResourceExhausted\w*|Resource exhausted): \S*\.tempstate\d+"
                            # HDF5's H5FD sec2 driver ('errno = 28, error message = ...'), SQLite's SQLITE_FULL
                            r"|\berrno = 28\b|database or disk is full")),
    ("quota", re.compile(r"Disk quota exceeded|\[Errno 122\]|\bEDQUOT\b|os error 122")),
    (
        "checkpoint_write_failed",
        re.compile(r"PytorchStreamWriter failed |unexpected pos \d+ vs \d+|file write failed"
                   r"|write\(\): fd \d+ failed with"
                   # torch's PyTorchStreamWriter::setup (torch.save's writer, not the reader); numpy's
                   # ndarray.tofile short write (np.save)
                   r"|(?:^|what\(\):\s+)(?:\w+Error: )?(?:\[enforce fail at [^\]]*\] \. )?File \S.* cannot be opened\.$"
                   r"|^(?:[\w.]*(?:Error|Exception): )?\d+ requested and \d+ written$"
                   # Lua torch's THDiskFile.c: a short fwrite
                   r"|write error: wrote \d+ blocks instead of \d+"),
    ),
)


def find(seg: Segment, t: str, exc: str | None, exc_form: bool, hits: list[Hit]) -> None:
    """Append this family's hits for one segment (`t` its text, `exc` its short exception class)."""
    # Disk.
    for name, rx in _DISK_RULES:
        if rx.search(t):
            hits.append(Hit(name, Category.DISK_FULL, ROOT, name, exc=seg.exc))
            break
