"""A launcher passing a child's death on: torchrun's `exitcode : -11` / `Signal 11 (SIGSEGV) received by
PID N` (with `error_file: <N/A>`, the child wrote no error), DeepSpeed's `exits with return code = -6`,
mpirun's and srun's reports of a rank's signal, an IDE's "interrupted by signal 11".
How the process ended, never why: where nothing else in the log speaks, the cause is unknown."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from supervisor.core.models import Category, Diagnosis
from supervisor.judge.diagnosis.findings import Finding

_RELAY_RE = re.compile(
    r"exitcode\s*:?\s*-?\d+|\bSignal \d+ \(SIG\w+\) received by PID|return code\s*=\s*-?\d+"
    # the launcher's own exception for it (torchrun, accelerate's subprocess call)
    r"|\bChildFailedError\b|\bCalledProcessError\b|\bRayActorError\b|\bActorDiedError\b|\bWorkerCrashedError\b"
    # torch.multiprocessing.spawn's parent: "process %d terminated with signal %s"
    r"|\bProcessExitedException\b"
    # Open MPI's help-mpirun.txt "... noticed that process rank %d with PID %d on node %s exited on signal
    # %d (%s)", Slurm's "srun: error: <node>: task <n>: <strsignal>", an IDE's "Process finished with exit
    # code 139 (interrupted by signal 11: SIGSEGV)"
    r"|\bexited on signal \d+|^srun: error: [^:]+: tasks? [\d,-]+: |\(interrupted by signal \d+: SIG\w+\)"
)
_SIGNAL_KINDS = ("segfault", "abort", "bus_error")
# unknown verdicts that are "nothing certain" (not a cancel or a scheduler's word): they get candidates
UNEXPLAINED = ("no_evidence", *_SIGNAL_KINDS)


def only_relayed(texts: Iterable[str]) -> bool:
    """True when every line found says only that a launcher saw a child end (or there is none)."""
    return all(_RELAY_RE.search(t) for t in texts)


def unexplained(d: Diagnosis, findings: list[Finding]) -> Diagnosis:
    """A crash verdict resting only on a launcher's relay of a child's signal is unknown: how, not why."""
    if d.category is not Category.CRASH_OTHER or d.subkind not in _SIGNAL_KINDS:
        return d
    if not only_relayed(f.text for f in findings):
        return d
    return dataclasses.replace(d, category=Category.UNKNOWN, summary=(
        f"{d.summary} Nothing but the signal (or a launcher's report of it) is in the log, not the process's"
        " own error: the cause is unknown."))
