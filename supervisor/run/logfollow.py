"""Follow one attempt's log like `tail -F`, within a budget per call.

The log is untrusted and may be anything: a flood of gigabytes, truncated by
a user (`> output.log`), deleted, or replaced. So the follower keeps the file
open (a deleted log is still read through the descriptor the training writes
to), notices truncation (size below our offset, or the bytes just before our offset no
longer those we read: the shim's log cap truncates in place and the training may refill
the file past our offset before we look; start again at 0) and
replacement (the path names another inode: finish the old one, then switch),
and never reads more than `budget_bytes` or `budget_s` per call, so one job's
output cannot stall the daemon's loop; the rest is read on the next call.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

SEEN_BYTES = 64


@dataclass
class LogFollower:
    path: Path
    offset: int = 0
    fd: int | None = None
    inode: int | None = None
    notes: list[str] = field(default_factory=list)  # what happened to the file, said once each
    seen: bytes = b""  # the last bytes read (up to SEEN_BYTES): a rewrite of the file changes them

    def _rewritten(self) -> bool:
        """The file was truncated and written again past our offset since we last read it."""
        if not self.seen or self.fd is None:
            return False
        try:
            return os.pread(self.fd, len(self.seen), self.offset - len(self.seen)) != self.seen
        except OSError:
            return False

    def _open(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        self.fd, self.inode = fd, os.fstat(fd).st_ino
        return True

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def pending(self) -> int:
        """Bytes written and not read yet (0 when the file cannot be seen)."""
        if self.fd is None and not self._open():
            return 0
        try:
            size = os.fstat(self.fd).st_size
        except OSError:
            return 0
        if size < self.offset or self._rewritten():
            return 1  # truncated: there is something to notice
        if size == self.offset and self._replaced():
            return 1
        return size - self.offset

    def _replaced(self) -> bool:
        try:
            return os.stat(self.path).st_ino != self.inode
        except FileNotFoundError:
            return False  # deleted: keep reading the open file, the training still writes to it
        except OSError:
            return False

    def read(self, budget_bytes: int, budget_s: float, chunk: int = 1 << 20):
        """Yield new chunks until the budget or the end of the file."""
        if self.fd is None and not self._open():
            return
        end = time.monotonic() + budget_s
        done = 0
        if self._rewritten():
            self.notes.append(f"the log was truncated and written again past {self.offset} bytes; reading it "
                              "again from its start")
            self.offset, self.seen = 0, b""
        while done < budget_bytes and time.monotonic() < end:
            try:
                size = os.fstat(self.fd).st_size
            except OSError:
                return
            if size < self.offset:
                self.notes.append(f"the log shrank from {self.offset} to {size} bytes (truncated); "
                                  "reading it again from its start")
                self.offset, self.seen = 0, b""
            data = os.pread(self.fd, min(chunk, budget_bytes - done), self.offset)
            if not data:
                if self._replaced():
                    self.notes.append("the log file was replaced; following the new one")
                    self.close()
                    self.offset, self.seen = 0, b""
                    if not self._open():
                        return
                    continue
                return
            self.offset += len(data)
            done += len(data)
            self.seen = (self.seen + data)[-SEEN_BYTES:]
            yield data

    def skip_to_tail(self, keep: int) -> int:
        """Jump over all but the last `keep` bytes (a flood backlog at the end); bytes skipped."""
        if self.fd is None and not self._open():
            return 0
        try:
            size = os.fstat(self.fd).st_size
        except OSError:
            return 0
        if size - self.offset <= keep:
            return 0
        skipped = size - keep - self.offset
        self.offset = size - keep
        try:
            self.seen = os.pread(self.fd, min(SEEN_BYTES, self.offset), self.offset - min(SEEN_BYTES, self.offset))
        except OSError:
            self.seen = b""
        self.notes.append(f"skipped {skipped} bytes of a log backlog; read the last {keep}")
        return skipped
