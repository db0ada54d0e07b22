"""Every other end: kills, segfaults, aborts, bus errors, device-side asserts, launcher summaries,
and any other Python exception."""

from __future__ import annotations

import re

from supervisor.core.models import Category
from supervisor.judge.diagnosis.hits import CRASH, MARKER, Hit, Segment

# --- crashes and kills ----------------------------------------------------
# The word the shell prints for a job ended by SIGKILL: glibc's strsignal(SIGKILL) in every locale
# glibc ships (libc.po), so a zh_CN box's "已杀死" reads like "Killed".
KILLED_WORDS = (
    "Killed", "Getötet", "Processus arrêté", "Terminado (killed)", "Ucciso", "Morto", "Matat", "Matado", "Убито",
    "Вбито", "Забіты", "Убијен", "已杀死", "強制結束", "強制終了", "죽었음", "Unicestwiony", "Geëlimineerd", "Dræbt",
    "Drept", "Dödad", "Tapettu", "Zabit (SIGKILL)", "Zabitý", "Pobit", "Ubijen", "Kilőve", "Σκοτώθηκε",
    "Süreç durduruldu", "Terbunuh", "Buĉita", "Bị buộc kết thúc", "Nutraukta (killed)", "Безусловно прекъснат",
)
_KILLED_ALT = "|".join(re.escape(w) for w in KILLED_WORDS)
_SIGKILL_RE = re.compile(
    r"exitcode\s*:?\s*-9\b|Signal 9 \(SIGKILL\)|killed by signal: Killed|received signal SIGKILL"
    # DeepSpeed's launcher; subprocess and torchelastic name the signal
    r"|exits with return code = -9\b|Signals\.SIGKILL\b|got signal: 9\b"
    # the shell's job report: "Killed", "./run.sh: line 5:  1234 Killed   python x.py", or glued to a tqdm bar
    rf"|(?:^|\])(?:{_KILLED_ALT})(?:\s+\(core dumped\))?$|:\s*\d+\s+(?:{_KILLED_ALT})(?:\s|$)"
)
_EXITCODE_RE = re.compile(r"exitcode\s*:?\s*(-?\d+)")
_LOCAL_RANK_RE = re.compile(r"local_rank:\s*(\d+)")
_SEGV_RE = re.compile(r"Segmentation fault|SIGSEGV|exitcode\s*:?\s*-11\b|Signal 11\b")
_ABORT_RE = re.compile(r"Aborted \(core dumped\)|SIGABRT|exitcode\s*:?\s*-6\b|Signal 6\b|Fatal Python error: Aborted|terminate called after throwing"
                       # glibc's assert(): "prog: file.cpp:223: int f(...): Assertion `expr' failed.", then abort()
                       r"|\.(?:c|cc|cpp|cxx|h|hpp):\d+: .*: Assertion [`']")
_BUS_RE = re.compile(r"[Bb]us error|SIGBUS")
# The host's message, or the kernel's own printf before it (an index or class id out of range: data or code).
_DEVICE_ASSERT_RE = re.compile(r"device-side assert triggered"
                               # (the kernel's name as the compiler spells it: "operator()", "cunn_ClassNLLCriterion...")
                               r"|\.cuh?:\d+: [^:\n]{1,200}?: block: \[\d+,\d+,\d+\], thread: \[\d+,\d+,\d+\] Assertion `")
_CHILD_FAILED_RE = re.compile(r"ChildFailedError")

# Exceptions that are consequences or launcher noise, not a crash cause of their own.
_NOT_A_CAUSE = {"ChildFailedError", "KeyboardInterrupt", "SystemExit"}
# A parent's report that a child process died, raised where it waited for it: how, never why. Ray's actor
# and worker deaths (ray/exceptions.py: "The actor died unexpectedly", "The worker died unexpectedly"); a
# launcher's CalledProcessError for the training interpreter it ran (accelerate's simple_launcher), not a
# build tool's (ninja, nvcc, make: their own output says what failed).
_RELAYED_DEATHS = frozenset({"RayActorError", "ActorDiedError", "WorkerCrashedError", "LocalRayletDiedError",
                             # torch.multiprocessing.spawn's join(): a child that exited without a Python error
                             "ProcessExitedException",
                             # torchrun's agent sent a signal from outside (SIGTERM, SIGHUP): stopped, not failed
                             "SignalException"})
# ...which older torch raised as a bare Exception with the same words (spawn.py: "process %d terminated with
# signal %s" / "... with exit code %d"); a child's own error comes as ProcessRaisedException with its traceback.
_SPAWN_EXIT_RE = re.compile(r"^process \d+ terminated with (?:signal \w+|exit code -?\d+)")
_LAUNCHED_CMD_RE = re.compile(r"Command '\[?'?(?:\S*/)?(?:python[\d.]*|torchrun|accelerate|deepspeed|llamafactory-cli"
                              r"|bash|sh|srun|mpirun|conda|uv)'?[,\]' ]")


def find(seg: Segment, t: str, exc: str | None, exc_form: bool, hits: list[Hit]) -> None:
    """Append this family's hits for one segment (`t` its text, `exc` its short exception class)."""
    # Crashes, kills, launcher summaries.
    if _SIGKILL_RE.search(t):
        hits.append(Hit("sigkill", Category.CRASH_OTHER, MARKER, "sigkill_unexplained"))
    elif _SEGV_RE.search(t):
        hits.append(Hit("segfault", Category.CRASH_OTHER, CRASH, "segfault"))
    elif _ABORT_RE.search(t) and not any(h.rule == "bad_alloc" for h in hits):
        hits.append(Hit("abort", Category.CRASH_OTHER, CRASH, "abort"))
    elif _BUS_RE.search(t):
        hits.append(Hit("bus_error", Category.CRASH_OTHER, CRASH, "bus_error"))
    if _DEVICE_ASSERT_RE.search(t):
        hits.append(Hit("device_assert", Category.CRASH_OTHER, CRASH, "device_assert", exc=seg.exc))
    if _CHILD_FAILED_RE.search(t):
        hits.append(Hit("child_failed", Category.CRASH_OTHER, MARKER, "launcher_summary", exc=seg.exc))

    if "cannot start" in t and t.startswith("oom-supervisor: cannot start"):
        hits.append(Hit("launch_failed", Category.CONFIG_ERROR, MARKER, "launch_failed"))

    if exc_form and not hits:
        if exc in _RELAYED_DEATHS or (exc == "CalledProcessError" and _LAUNCHED_CMD_RE.search(t)) or (
                exc == "Exception" and _SPAWN_EXIT_RE.match(seg.exc_msg or "")):
            hits.append(Hit("child_failed", Category.CRASH_OTHER, MARKER, "launcher_summary", exc=seg.exc))
        elif exc == "KeyboardInterrupt":
            hits.append(Hit("interrupted", Category.CRASH_OTHER, CRASH, "interrupted", exc=seg.exc))
        elif exc not in _NOT_A_CAUSE:
            hits.append(Hit("python_exception", Category.CRASH_OTHER, CRASH, "python_exception", exc=seg.exc))
