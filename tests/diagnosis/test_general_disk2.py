"""A full disk in the words of the tools that hit it (issue 29), each from its source: Go's syscall
ENOSPC text (docker/containerd pulls, lower-case), HF datasets' builder.py room check, Windows'
ERROR_DISK_FULL."""

import pytest

from supervisor.core.models import Category
from supervisor.judge.diagnosis import diagnose_bytes


def _tb(exc_line: str) -> bytes:
    return ('Traceback (most recent call last):\n  File "/home/u/train.py", line 3, in <module>\n    main()\n'
            '  File "/x/datasets/builder.py", line 40, in download_and_prepare\n    raise X\n'
            f"{exc_line}\n").encode()


DISK = {
    "go_enospc": b"docker: failed to register layer: write /var/lib/docker/overlay2/abc/diff/x.so: no space left on device.\n",
    "datasets_room": _tb("OSError: Not enough disk space. Needed: 134.92 GiB (download: 41.97 GiB, generated: 92.95 GiB,"
                         " post-processed: Unknown size)"),
    "windows": _tb("OSError: [WinError 112] There is not enough space on the disk"),
}


@pytest.mark.parametrize("name", sorted(DISK))
def test_disk_full_spellings(name: str) -> None:
    d = diagnose_bytes(DISK[name])
    assert d.category is Category.DISK_FULL, (name, d.summary)
