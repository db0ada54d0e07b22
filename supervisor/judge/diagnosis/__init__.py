"""Failure diagnosis: why an attempt ended, from its log, exit status and host facts.

    scanner = LogScanner()
    for chunk in stream:                 # live: as the log grows
        fatal = scanner.feed(chunk)      # non-empty -> tear the attempt down now
    diagnosis = scanner.finish(exit_record, host_evidence)

Detection only: what to do about a diagnosis is the policy's business.
Nothing here imports torch; the optional `google-re2` only speeds the prefilter.
"""

from __future__ import annotations

import os
from typing import Any

from supervisor.core.models import Diagnosis, ExitRecord, HostEvidence
from supervisor.judge.diagnosis.scan_patterns import PREFILTER_ENGINE
from supervisor.judge.diagnosis.scanner import LogScanner

CHUNK_BYTES = 1 << 20

__all__ = ["PREFILTER_ENGINE", "LogScanner", "diagnose_bytes", "diagnose_file"]


def diagnose_bytes(data: bytes, exit: ExitRecord | None = None, host: HostEvidence | None = None) -> Diagnosis:
    """Diagnose a whole log (or an excerpt) held in memory."""
    scanner = LogScanner()
    scanner.feed(data)
    return scanner.finish(exit, host)


def diagnose_file(path: str | os.PathLike[str], exit: ExitRecord | None = None,
                  host: HostEvidence | None = None, *, chunk_bytes: int = CHUNK_BYTES,
                  scanner: Any = None) -> Diagnosis:
    """Diagnose a log file, streaming it in `chunk_bytes` pieces (bounded memory)."""
    scanner = scanner or LogScanner()
    with open(path, "rb", buffering=0) as fh:
        while True:
            chunk = fh.read(chunk_bytes)
            if not chunk:
                break
            scanner.feed(chunk)
    return scanner.finish(exit, host)
