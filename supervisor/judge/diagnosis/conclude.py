"""From findings + exit status + host memory facts to one Diagnosis (pure).

Root-cause order (documented here, tested in tests/diagnosis):
  1. The supervisor's own stops: `cancel`/`shutdown` are not failures (unknown);
     returncode 0 is success (an OOM the program retried is mentioned).
  2. The command never started (launch_error, or exit 127 + the shim's line): config_error.
     A scheduler's TIMEOUT/PREEMPTED/CANCELLED (unknown) or NODE_FAIL (environment) decides;
     CANCELLED not when the supervisor stopped it itself (fatal line, hang, ...: its own scancel).
  3. Among the log's STRUCTURAL findings (an exception ending a traceback, cut or not; a C++
     terminate/what() block; a runtime's abort line; a fault line when the process then aborted;
     the final error of the log, teardown.py):
       tier 1 ROOT  gpu_oom, host_oom, device_fault, disk_full, config_error, numeric, environment
       tier 2 COMM  NCCL/RCCL watchdog timeouts and errors, rendezvous/socket errors
       tier 3 CRASH other Python exceptions, segfault, abort, device-side assert
     per rank, the exception that ends its LAST traceback (within a chain of tracebacks, the
     FIRST: the cause, not what its handler raised); across ranks the EARLIEST, tier 1 first: an illegal memory access
     that trips the NCCL watchdog is a device_fault, an OOM on rank 3 that makes rank 0 time
     out is a gpu_oom, whatever order the ranks' stderr reached the log in. A tier-3
     exception right after a library's OOM message (same rank, <= 64 lines) is that OOM.
     Disk full must be confirmed by statvfs when it was measured. A device fault the kernel
     reported for the window (kernel.py) is tier 1 without a line; fp16 loss-scale collapse and a
     NaN tail of logged losses are tier 1 at their last line.
  4. A SIGKILL (exit -9/137, torchrun `exitcode : -9`, `Signal 9 (SIGKILL)`)
     is host_oom only when memory evidence corroborates it: the cgroup's
     oom_kill counter > 0, a kernel OOM line (HostEvidence), min_available_bytes
     <= max(64 MiB, 2% of the memory limit), the supervisor's own memory-limit stop, or
     the scheduler's OUT_OF_MEMORY. Otherwise it is crash_other/sigkill_unexplained, unless
     nothing was measured and the log itself reports the kill (shell, launcher): then unknown,
     its "why not" naming host_oom first (a kill says it came, not who sent it); a DataLoader
     worker killed alone (the OOM killer picks one process) is a likely host OOM, strength "hint".
     A kill the supervisor made itself (stopped_by fatal_signal/hang) is never
     read as a kill: the log decides.
  5. `stopped_by == "hang"`: hang, unless the log shows a tier 1-2 cause; an OOM seen in the
     attempt (structural or a hint) is the hang's likely cause ("a hang after an OOM on rank N at
     line L"); a watchdog's own line, a hint, refines it to comm_failure.
  6. Otherwise exit-signal facts (segfault, abort, SIGTERM), then HINTS (free text outside
     a traceback: strength "hint"; a terminal category becomes crash_other; an environment or
     comm line that training advanced past does not count), then a pasted log (no exit record)
     that stops while loading or starting up: hang (hint), then unknown.

GPU OOM derived numbers:
  shortfall = max(0, tried_to_allocate - usable), where usable is `free`, or,
    under a memory-fraction cap (`allowed`), min(free, allowed - allocated -
    reserved_unallocated - private_pools).
  fragmentation = reserved_unallocated >= tried_to_allocate AND
    reserved_unallocated >= 5% of capacity (the cap when `allowed` is set), or
    >= 256 MiB when no capacity is printed: the allocator held enough free
    cached memory for the request, just not in one piece.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from supervisor.core.models import Category, Diagnosis, Evidence, ExitRecord, HostEvidence, Phase
from supervisor.judge.diagnosis import kernel, teardown
from supervisor.judge.diagnosis.candidates import likely_categories
from supervisor.judge.diagnosis.families import hang, relay
from supervisor.judge.diagnosis.families.crash import _SIGKILL_RE
from supervisor.judge.diagnosis.families.nan_tail import nan_tail_run
from supervisor.judge.diagnosis.findings import Finding, ScanState
from supervisor.judge.diagnosis.hits import COMM, CRASH, HINT, MARKER, ROOT, Hit
from supervisor.judge.diagnosis.kernel import KERNEL_OOM_RE
from supervisor.judge.diagnosis.sizes import human
from supervisor.judge.diagnosis.wording import (
    NEAR_ZERO_FLOOR,
    NEAR_ZERO_FRACTION,
    Root,
    diagnosis_of,
    fingerprint,
    plain,
    recovered_note,
    tail_evidence,
)

REPEATED_MIN_SCALE_OVERFLOWS = 3
NEAR_FULL_BYTES = 1024**3  # a folder with less free space than this is full for a checkpoint write
# Categories the policy ends a job on or pauses the queue for: never from a hint alone.
TERMINAL = frozenset({Category.CONFIG_ERROR, Category.DISK_FULL, Category.NUMERIC, Category.DEVICE_FAULT})
_ABORT_SIGNALS = ("SIGABRT", "SIGSEGV", "SIGBUS")
# Scheduler states that say why the job ended by themselves (OUT_OF_MEMORY corroborates a kill instead).
_SCHEDULER_VERDICTS = {
    "TIMEOUT": (Category.UNKNOWN, "scheduler_timeout", "the job reached its time limit; not a failure of the training"),
    "PREEMPTED": (Category.UNKNOWN, "preempted", "the job was preempted for another one; not a failure"),
    "CANCELLED": (Category.UNKNOWN, "cancelled", "someone cancelled the job; not a failure"),
    "NODE_FAIL": (Category.ENVIRONMENT, "node_fail", "the node failed; a retry on a healthy node is expected to work"),
    "BOOT_FAIL": (Category.ENVIRONMENT, "node_fail", "the node failed to boot; a retry elsewhere is expected to work"),
    "DEADLINE": (Category.UNKNOWN, "scheduler_timeout", "the job reached its deadline; not a failure of the training"),
}
REFINE_WINDOW = 64
# Subkinds that say less than a sibling of the same category (a failed write vs. "no space left").
_GENERIC_SUBKINDS = frozenset({"checkpoint_write_failed", "python_exception", "driver"})
_PHASE_ORDER = (Phase.CHECKPOINT_LOAD, Phase.CHECKPOINT_SAVE, Phase.EVALUATION, Phase.MODEL_LOAD, Phase.TRAIN_STEP)  # lines between a library's OOM message and the exception it raised

_SUPERVISOR_STOPS = ("cancel", "shutdown")
_OWN_KILLS = ("fatal_signal", "hang")
_OWN_STOPS = (*_OWN_KILLS, "internal_error", "memory_limit", "orphaned")  # the supervisor's scancel, not someone's

def _signal_name(exit: ExitRecord | None) -> str | None:
    if exit is None:
        return None
    if exit.signal:
        name = exit.signal.upper()
        return name if name.startswith("SIG") else "SIG" + name
    rc = exit.returncode
    table = {9: "SIGKILL", 11: "SIGSEGV", 6: "SIGABRT", 15: "SIGTERM", 7: "SIGBUS", 2: "SIGINT"}
    if rc is not None and rc < 0:
        return table.get(-rc, f"signal {-rc}")
    if rc is not None and 128 < rc < 160:
        return table.get(rc - 128)
    return None


def _memory_corroboration(host: HostEvidence | None) -> tuple[list[str], list[Evidence]]:
    """Words and evidence lines that show the host ran out of memory."""
    if host is None:
        return [], []
    words: list[str] = []
    ev: list[Evidence] = []
    if host.cgroup_oom_kills:
        words.append(f"cgroup oom_kill counter = {host.cgroup_oom_kills}")
    if host.limit_enforced_kill:
        words.append("the supervisor stopped it when its processes' memory went over the job's limit")
    if host.scheduler_state == "OUT_OF_MEMORY":
        words.append("the scheduler reports OUT_OF_MEMORY")
    for line in host.kernel_lines:
        if KERNEL_OOM_RE.search(line):
            ev.append(Evidence(line_no=0, text=line.strip()[:2000], rule="host:kernel_oom"))
    if ev:
        words.append("kernel log reports an OOM kill")
    if host.min_available_bytes is not None:
        limit = host.memory_limit_bytes or 0
        if host.min_available_bytes <= max(NEAR_ZERO_FLOOR, NEAR_ZERO_FRACTION * limit):
            words.append(f"available memory fell to {human(host.min_available_bytes)}")
    return words, ev


def _measured(host: HostEvidence | None) -> bool:
    """Was any host memory fact gathered that would have shown an OOM kill?"""
    if host is None:
        return False
    return (host.cgroup_oom_kills is not None or bool(host.kernel_log_read) or host.min_available_bytes is not None
            or host.limit_enforced_kill or host.scheduler_state is not None)


def _kernel_root(host: HostEvidence | None, state: ScanState) -> Root | None:
    """A device fault the kernel reported for the attempt's window (Xid, fallen off the bus, AER)."""
    if host is None or not host.kernel_lines:
        return None
    faults = kernel.device_faults(host.kernel_lines)
    f = kernel.strongest(faults)
    if f is None:
        return None
    what = f"Xid {f.code}" if f.code is not None else f.subkind.replace("_", " ")
    ev = [Evidence(line_no=0, text=x.text, rule=f"host:kernel_{x.subkind}") for x in faults[:3]]
    return Root(hit=Hit(f"kernel_{f.subkind}", Category.DEVICE_FAULT, ROOT, f.subkind, vendor=f.vendor),
                 line_no=0, text=f.text, rank=None, phase=state.context_phase,
                 notes=[f"the kernel log reports {what}: {f.text[:200]}"], extra=ev)


def _promote(f: Finding, why: str) -> Finding:
    """A finding that the log's structure shows decisive: structural, with its *_mention rule made whole."""
    hit = f.hit
    if hit.tier == HINT and hit.rule.endswith("_mention"):
        hit = dataclasses.replace(hit, rule=hit.rule[: -len("_mention")], tier=ROOT, fatal=True)
    return dataclasses.replace(f, hit=hit, structural=True, notes=[*f.notes, why])


def _final_error(state: ScanState, active: list[Finding]) -> list[Finding]:
    """The findings of the final error block (teardown.py), made structural: the last thing the log
    says before it ends, when it is an error. Voided where training advanced after it."""
    block = teardown.final_block(state.program_tail(), state.prefixes, lambda t: _SIGKILL_RE.search(t) is not None)
    if block is None:
        return []
    first, last = block
    if state.last_advance_line > last:
        return []
    found = [f for f in active if first <= f.line_no <= last and f.tier in (ROOT, COMM, CRASH, HINT)
             and f.rule not in ("nan_loss", "sigkill") and f.tier != MARKER]
    found = [f for f in found if f.tier != HINT or f.rule.endswith("_mention")]
    if not found:
        return []
    # One block, one error: like a chain, its first (strongest) finding speaks for it.
    return [dataclasses.replace(_promote(f, "the last error in the log (no traceback header above it in the log)"),
                                chain=-first) if not f.structural else f for f in found]


SCALE_RUN = 4  # overflows in a row, each lowering the loss scale further
LOW_SCALE = 2.0  # DeepSpeed's default minimum is 1; a run that got here has nowhere left to go
# A structural cause a single non-finite loss report may still come before (and explain): a crash the
# NaN caused, or a numeric one; an OOM, a device fault or a config error is never outranked by one.
_NAN_MAY_FOLLOW = (Category.CRASH_OTHER, Category.NUMERIC)


def _scale_collapse(state: ScanState) -> Root | None:
    """fp16 loss-scale collapse shown only as overflow lines: every step overflowed, the scale halving
    down to its minimum, and the log ends there."""
    run = state.scale_run
    if run is None or run[0] < SCALE_RUN or run[1] > LOW_SCALE or state.last_advance_line > run[3]:
        return None
    block = teardown.final_block(state.program_tail(), state.prefixes)
    if block is None or block[1] != run[3]:
        return None
    text = next((t for n, t in state.program_tail() if n == run[3]), "")
    return Root(hit=Hit("loss_scale_collapse", Category.NUMERIC, ROOT, "loss_scale_at_minimum"),
                 line_no=run[3], text=text.strip()[:2000], rank=None, phase=Phase.TRAIN_STEP,
                 notes=[(f"{run[0]} gradient overflows in a row (lines {run[2]}-{run[3]}), the fp16 loss scale"
                        f" halving down to {run[1]:g}: every step was skipped")])


def _pick(findings: list[Finding], tier: int) -> Finding | None:
    best = [f for f in findings if f.tier == tier]
    return min(best, key=lambda f: (f.line_no, f.seq)) if best else None


def _root_of(f: Finding) -> Root:
    return Root(hit=f.hit, line_no=f.line_no, text=f.text, rank=f.rank, phase=f.phase, notes=list(f.notes))


def conclude(state: ScanState, exit: ExitRecord | None, host: HostEvidence | None) -> Diagnosis:
    """The verdict with its fingerprint; a host OOM also says the job's memory limit and peak seen."""
    d = relay.unexplained(_with_memory(_conclude(state, exit, host), host), state.findings)
    if d.category is Category.UNKNOWN and d.subkind in relay.UNEXPLAINED:  # nothing certain: where to look
        d = dataclasses.replace(d, candidates=likely_categories(state))
    if state.internal_errors:
        d = dataclasses.replace(d, numbers={**d.numbers, "scanner_errors": state.internal_errors},
                                summary=f"{d.summary} ({state.internal_errors} log line(s) could not be read.)")
    return dataclasses.replace(d, fingerprint=fingerprint(d))


def _with_memory(d: Diagnosis, host: HostEvidence | None) -> Diagnosis:
    if d.category is not Category.HOST_OOM or host is None:
        return d
    nums = dict(d.numbers)
    said = []
    if host.memory_limit_bytes:
        nums["memory_limit"] = host.memory_limit_bytes
        said.append(f"the job's limit is {human(host.memory_limit_bytes)}"
                    + (f" ({host.limit_mechanism})" if host.limit_mechanism else ""))
    if host.peak_rss_bytes:
        nums["peak_host_memory"] = host.peak_rss_bytes
        said.append(f"peak seen {human(host.peak_rss_bytes)}")
    if not said:
        return d
    return dataclasses.replace(d, numbers=nums, summary=f"{d.summary} Memory: {', '.join(said)}.")


@dataclass
class _Case:
    """One attempt's end as the steps below read it; `_weigh` fills in what the log and host prove."""

    state: ScanState
    exit: ExitRecord | None
    host: HostEvidence | None
    stopped_by: str | None
    signal: str | None
    active: list[Finding] = field(default_factory=list)
    kill_marker: Finding | None = None
    own_kill: bool = False
    exit_killed: bool = False
    killed: bool = False
    root: Root | None = None

    def last_step(self, lead: str = " Last step seen") -> str:
        return f"{lead} {self.state.last_step}." if self.state.last_step is not None else ""


def _conclude(state: ScanState, exit: ExitRecord | None, host: HostEvidence | None) -> Diagnosis:
    case = _Case(state, exit, host, exit.stopped_by if exit is not None else None, _signal_name(exit))
    for step in STEPS:
        d = step(case)
        if d is not None:
            return d
    raise AssertionError("the last step always concludes")  # pragma: no cover


def _stopped_by_us(c: _Case) -> Diagnosis | None:
    if c.stopped_by in _SUPERVISOR_STOPS:
        return plain(Category.UNKNOWN, "stopped_by_supervisor",
                     f"Stopped by the supervisor ({c.stopped_by}); not a failure." + c.last_step(), c.state)
    return None


def _clean_exit(c: _Case) -> Diagnosis | None:
    if c.exit is None or c.exit.returncode != 0 or c.stopped_by is not None:
        return None
    nan = [f for f in c.state.findings if f.rule == "nan_loss"]
    extra = f" NaN/Inf losses were logged (first at line {nan[0].line_no})." if nan else ""
    return plain(Category.SUCCESS, None, "Exited with status 0." + c.last_step(" Last step")
                 + recovered_note(c.state) + extra, c.state)


def _never_started(c: _Case) -> Diagnosis | None:
    return _launch_failure(c.state, c.exit)


def _scheduler_said(c: _Case) -> Diagnosis | None:
    sched = c.host.scheduler_state if c.host is not None else None
    if sched == "CANCELLED" and c.stopped_by in _OWN_STOPS:
        return None  # the supervisor's own stop (fatal line, hang, ...) cancelled it: the log decides
    if sched not in _SCHEDULER_VERDICTS:
        return None
    category, subkind, words = _SCHEDULER_VERDICTS[sched]
    return dataclasses.replace(plain(category, subkind, f"The scheduler reports {sched}: {words}." + c.last_step(),
                                     c.state, tail_evidence(c.state, 2)),
                               numbers={"scheduler_state": sched})


def _weigh(c: _Case) -> Diagnosis | None:
    """The log's structural findings, the kill and its corroboration, the loss scale, the NaN tail
    and the kernel's own report: the root cause among them (a disk-full verdict the disk's
    measured free space contradicts is demoted here)."""
    state, host = c.state, c.host
    c.active = active = [f for f in state.findings if not f.recovered]
    decisive = _decisive(active, c.signal)
    if c.stopped_by != "fatal_signal":  # our own live stop: the finding that triggered it decides
        seen = {(f.line_no, f.rule) for f in decisive}
        decisive += [f for f in _final_error(state, active) if (f.line_no, f.rule) not in seen]
    c.own_kill = c.stopped_by in _OWN_KILLS
    c.exit_killed = not c.own_kill and c.signal == "SIGKILL"
    c.kill_marker = next((f for f in active if f.rule == "sigkill"), None)
    c.killed = (c.exit_killed or c.kill_marker is not None or bool(host and host.limit_enforced_kill)
                or bool(host and host.scheduler_state == "OUT_OF_MEMORY"))
    candidates: list[Root] = []
    first = _refine(_pick_structural(decisive), active)
    if first is not None:
        candidates.append(_root_of(first))
    if state.min_loss_scale_overflows >= REPEATED_MIN_SCALE_OVERFLOWS:
        candidates.append(Root(hit=Hit("loss_scale_stuck", Category.NUMERIC, ROOT, "loss_scale_at_minimum"),
                               line_no=0, text="", rank=None, phase=state.context_phase,
                               notes=[f"{state.min_loss_scale_overflows} overflows at loss scale 1"]))
    else:
        collapse = _scale_collapse(state)
        if collapse is not None:
            candidates.append(collapse)
    nan_run = nan_tail_run(state.program_tail(), first is None or first.hit.category in _NAN_MAY_FOLLOW)
    if nan_run is not None:
        candidates.append(nan_run)
    c.root = _choose(candidates, _host_root(c), _kernel_root(host, state))
    if c.root is not None and c.root.hit.category is Category.DISK_FULL:
        c.root, demoted = _confirm_disk(c.root, host, state)
        return demoted
    return None


def _host_root(c: _Case) -> Root | None:
    """A kill (or the cgroup's OOM kill counter) that host memory evidence corroborates: host OOM.
    The kernel's OOM-kill line is a kill in itself: the daemon keeps only those naming the job's own
    processes or cgroup (run/kernel_log.py), so one rank killed under a launcher that then exits 1
    (DeepSpeed's "Killing subprocess", torchrun's exit code) is this job's host OOM too."""
    host, kill_marker = c.host, c.kill_marker
    words, kernel_ev = _memory_corroboration(host)
    if not words or not (c.killed or (host and host.cgroup_oom_kills) or kernel_ev):
        return None
    if host is not None and host.limit_enforced_kill and not c.exit_killed and kill_marker is None:
        what = "the supervisor stopped the job at its memory limit"
    elif c.killed:
        what = "SIGKILL " + ("(exit status)" if c.exit_killed else f"(line {kill_marker.line_no})")  # type: ignore[union-attr]
    elif host and host.cgroup_oom_kills:
        what = "a process in the job's cgroup was OOM-killed"
    else:
        what = "the kernel's OOM killer killed a process of the job"
    return Root(
        hit=Hit("oom_killer", Category.HOST_OOM, ROOT, "oom_killer", vendor="cpu"),
        line_no=kill_marker.line_no if kill_marker else 0, text=kill_marker.text if kill_marker else "",
        rank=kill_marker.rank if kill_marker else None,
        phase=kill_marker.phase if kill_marker else c.state.context_phase,
        notes=[f"{what}, corroborated by: {', '.join(words)}"], extra=kernel_ev,
        line_rule="sigkill" if kill_marker else None,
    )


def _hung(c: _Case) -> Diagnosis | None:
    if c.stopped_by != "hang":
        return None
    root, state = c.root, c.state
    oom = [f for f in c.active if f.category in (Category.GPU_OOM, Category.HOST_OOM)]
    if root is not None and root.hit.tier in (ROOT, COMM) and root.hit.category not in OOM_CATEGORIES:
        return diagnosis_of(root, state, " The supervisor stopped it after no progress.")
    if root is not None and root.hit.category in OOM_CATEGORIES:
        return diagnosis_of(root, state, _hang_after_oom(root.rank, root.line_no))
    if oom:
        # One rank ran out of memory and the others wait for it in a collective: the OOM is the
        # hang's likely cause, and a retry of the same configuration would hang the same way.
        f = max(oom, key=lambda f: (f.tier == ROOT, f.line_no, f.seq))
        return diagnosis_of(_root_of(f), state, _hang_after_oom(f.rank, f.line_no), strength="hint")
    comm = _pick([f for f in c.active if not f.structural], COMM)
    if comm is not None:  # a watchdog's own log line says why nothing moved (a retry either way)
        return diagnosis_of(_root_of(comm), state, " The supervisor stopped it after no progress (from a"
                            " runtime's log line, not an exception: weaker evidence).", strength="hint")
    return plain(Category.HANG, "no_progress",
                 "No output or progress for the hang timeout; the supervisor stopped the attempt."
                 + (c.last_step() or " No training step was seen."), state, tail_evidence(state))


def _rooted(c: _Case) -> Diagnosis | None:
    return diagnosis_of(c.root, c.state) if c.root is not None else None


def _fatal_line_gone(c: _Case) -> Diagnosis | None:
    if c.stopped_by != "fatal_signal":
        return None
    return plain(Category.UNKNOWN, "no_evidence",
                 "The supervisor stopped the attempt on a fatal line, but no decisive failure is in the log now.",
                 c.state)


_WORKER_KILLED = "DataLoader worker"


def _unmeasured_kill(c: _Case) -> Diagnosis | None:
    """The log's own report of the kill (the shell's "Killed", a launcher's "-9") and nothing
    measured either way: the kernel's OOM killer is the likeliest sender, but a kill says only that
    it came. `unknown` (no remedy acts on it), its "why not" naming host_oom and the kill line."""
    log_kill = max((f for f in c.active if f.rule == "sigkill"), key=lambda f: f.line_no, default=None)
    if not (c.killed and log_kill is not None and not _measured(c.host) and not c.own_kill
            and c.state.last_advance_line <= log_kill.line_no):
        return None
    first_kill = c.kill_marker or log_kill
    if _WORKER_KILLED in log_kill.text:
        # One DataLoader worker killed while its parent lived to say so: the OOM killer picks one
        # process; a person, a scheduler or a watchdog ends the job. A likely cause, said as such.
        root = Root(hit=Hit("oom_killer_unconfirmed", Category.HOST_OOM, ROOT, "oom_killer_unconfirmed", vendor="cpu"),
                    line_no=log_kill.line_no, text=log_kill.text, rank=log_kill.rank, phase=log_kill.phase,
                    notes=[("a DataLoader worker alone was killed by SIGKILL, most likely by the kernel's OOM killer;"
                            " no host memory evidence (cgroup counter, kernel log, memory samples) was gathered"
                            " to confirm it")],
                    line_rule="sigkill")
        return diagnosis_of(root, c.state, " (a likely cause, not confirmed: weaker evidence)", strength="hint")
    return plain(Category.UNKNOWN, "no_evidence",
                 f"Killed by SIGKILL (line {first_kill.line_no}); no host memory evidence (cgroup counter, kernel"
                 " log, memory samples) was gathered, so the cause is not known: most likely the kernel's OOM"
                 " killer, possibly an outside `kill -9`.",
                 c.state, (first_kill.evidence(),), phase=first_kill.phase)


def _unexplained_kill(c: _Case) -> Diagnosis | None:
    if not c.killed:
        return None
    kill_marker, state = c.kill_marker, c.state
    where = f"exit status ({c.signal})" if c.exit_killed else (
        f"line {kill_marker.line_no}" if kill_marker else "the supervisor's memory-limit enforcement")
    ev = (kill_marker.evidence(),) if kill_marker else ()
    gathered = "no host memory evidence was gathered" if c.host is None else \
        "the cgroup OOM counter, kernel log and memory samples show no memory exhaustion"
    return Diagnosis(
        category=Category.CRASH_OTHER, subkind="sigkill_unexplained",
        summary=(f"Killed by SIGKILL ({where}); {gathered}, so this is not called a host OOM: it may be the"
                 f" kernel OOM killer or an outside `kill -9`."),
        vendor="hip" if state.hip else ("cuda" if state.cuda else "unknown"),
        phase=kill_marker.phase if kill_marker else state.context_phase,
        rank=kill_marker.rank if kill_marker else None,
        evidence=ev + tail_evidence(state, 2),
    )


_BY_SIGNAL = {"SIGSEGV": "segfault", "SIGABRT": "abort", "SIGBUS": "bus_error", "SIGTERM": "sigterm",
              "SIGINT": "interrupted"}


# Retried kinds read from text alone: training that advanced after the line shows it was survived
# (a hub request that fell back to the cache, a connect NCCL retried, an exception a program logged
# and went on from): not what ended the run.
_SURVIVABLE_TEXT = (Category.ENVIRONMENT, Category.COMM_FAILURE)


def _signal_or_hint(c: _Case) -> Diagnosis | None:
    after = c.state.last_advance_line
    hint = _pick_hint([f for f in c.active if f.structural or f.line_no >= after
                       or (f.category not in _SURVIVABLE_TEXT and f.rule != "python_exception")])
    if c.signal in _BY_SIGNAL and (hint is None or hint.tier not in (ROOT, COMM)):
        return plain(Category.CRASH_OTHER, _BY_SIGNAL[c.signal],
                     f"Ended by {c.signal} with no recognised error in the log.", c.state, tail_evidence(c.state))
    return _hint_diagnosis(hint, c.state) if hint is not None else None


def _stalled(c: _Case) -> Diagnosis | None:
    """Nothing recognised, exit status unknown (a pasted log), and the log stops mid-way (loading,
    a bar, the process group forming): it stopped making progress. Said as a likely cause."""
    if c.exit is not None:
        return None
    at = hang.stalled_at(c.state.program_tail(), c.state.prefixes)
    if at is None:
        return None
    line_no, text = at
    return dataclasses.replace(
        plain(Category.HANG, "stalled_log",
              f"The log stops at line {line_no} ({text[:160]!r}) with no error, kill or exit after it: the run"
              " stopped making progress (or was stopped without a word; its exit status is unknown)."
              + c.last_step(), c.state, tail_evidence(c.state, 2)),
        strength="hint")


def _nothing_recognised(c: _Case) -> Diagnosis:
    rc = c.exit.returncode if c.exit is not None else None
    if rc is None:
        return plain(Category.UNKNOWN, "no_evidence", "No failure evidence in the log.", c.state,
                     tail_evidence(c.state))
    return plain(Category.UNKNOWN, "no_evidence", f"Exited with status {rc}; the log shows no recognised error.",
                 c.state, tail_evidence(c.state))


# The verdict's precedence, first that speaks wins (the module docstring says why each sits where it does).
STEPS = (
    _stopped_by_us,       # 1. cancel/shutdown: not a failure
    _clean_exit,          #    status 0: success
    _never_started,       # 2. the command never started: config_error
    _scheduler_said,      #    TIMEOUT, PREEMPTED, CANCELLED, NODE_FAIL decide
    _weigh,               # 3. the root cause the log and host prove (disk-full checked against statvfs)
    _hung,                # 5. the supervisor's hang stop, refined by what the log shows
    _rooted,              # 3. that root cause
    _fatal_line_gone,     #    stopped on a fatal line no longer decisive
    _unmeasured_kill,     # 4. a kill the log reports, nothing measured: unknown, host_oom most likely
    _unexplained_kill,    #    any other kill: crash_other/sigkill_unexplained
    _signal_or_hint,      # 6. a fatal signal, then hints
    _stalled,             #    a pasted log that stops mid-way with nothing after: a likely hang (hint)
    _nothing_recognised,  #    unknown
)


OOM_CATEGORIES = (Category.GPU_OOM, Category.HOST_OOM)


def _hang_after_oom(rank: int | None, line_no: int) -> str:
    on = f" on rank {rank}" if rank is not None else ""
    return (f" The supervisor stopped it after no progress: a hang after an OOM{on} at line {line_no}, its"
            " likely cause (the other ranks wait for it in a collective); the OOM is what to remedy.")


def _decisive(active: list[Finding], signal: str | None) -> list[Finding]:
    """Structural findings: exceptions ending a traceback, plus a runtime's fault line that the
    exit status corroborates (a device fault printed just before SIGABRT/SIGSEGV/SIGBUS)."""
    out = [f for f in active if f.structural and f.tier != HINT]
    # torchrun's summary of a child that aborted ("exitcode: -6") counts like the exit status.
    aborted = signal in _ABORT_SIGNALS or any(f.rule in ("abort", "segfault", "bus_error") for f in active)
    if aborted:
        out += [f for f in active if not f.structural and f.tier == ROOT
                and (f.category is Category.DEVICE_FAULT or f.rule == "bad_alloc")]
    return out


def _refine(first: Finding | None, active: list[Finding]) -> Finding | None:
    """A generic exception (tier 3) that ended a traceback, just after a library's own out-of-memory
    message on the same rank (MIOpen, rocBLAS, NCCL print theirs, then raise a vague error): the
    exception is the structural fact, the message the detail. Only OOM kinds (remedies, not
    verdicts that end the job) are taken from such text; after an NCCL error ("unhandled cuda error": a
    CUDA call inside NCCL failed, its WARN line says which; a collective fails on the ranks that wait
    for the one that ran out), only an OOM, on any rank."""
    if first is None or first.tier not in (COMM, CRASH):
        return first
    near = [f for f in active if not f.structural and f.tier == ROOT
            and f.category in (Category.GPU_OOM, Category.HOST_OOM, *((Category.DISK_FULL,) * (first.tier == CRASH)))
            and (f.rank in (first.rank, None) or first.tier == COMM) and 0 <= first.line_no - f.line_no <= REFINE_WINDOW]
    if not near:
        return first
    f = max(near, key=lambda f: (f.line_no, f.seq))
    phase = f.phase if f.phase is not Phase.UNKNOWN else first.phase
    return dataclasses.replace(f, structural=True, phase=phase,
                               notes=[*f.notes, f"it ended in {first.text[:200]!r} (line {first.line_no})"])


def _pick_structural(findings: list[Finding]) -> Finding | None:
    """The deciding structural finding.

    Per rank, the exception that ends its LAST traceback decides (a chained or later exception
    is what ended that process); across ranks the earliest wins, since ranks flush their stderr
    independently. Tier 1 (root causes) before tiers 2-3 (comm failures and crashes are often
    consequences of a root cause on another rank).
    """
    for tiers in ((ROOT,), (COMM, CRASH)):
        per_rank: dict[int | None, Finding] = {}
        for f in findings:
            if f.tier in tiers:
                cur = per_rank.get(f.rank)
                if cur is None or (f.line_no, f.seq) > (cur.line_no, cur.seq):
                    per_rank[f.rank] = f
        for rank, last in list(per_rank.items()):
            if last.chain is not None:
                # Chained exceptions ("During handling of the above exception..."): the first is the cause;
                # a later one of the same category may name it better (ENOSPC after a failed stream write).
                same = [f for f in findings if f.chain == last.chain and f.rank == rank]
                lead = min(same, key=lambda f: (f.tier, f.line_no, f.seq))
                kin = [f for f in same if f.category is lead.category and f.tier == lead.tier]
                best = min(kin, key=lambda f: (f.hit.subkind in _GENERIC_SUBKINDS, f.line_no, f.seq))
                phase = best.phase
                if phase is Phase.UNKNOWN:  # where the chain as a whole was
                    phase = next((p for p in _PHASE_ORDER for f in same if f.phase is p), Phase.UNKNOWN)
                if best.tier in tiers and (best is not last or phase is not best.phase):
                    note = ([(f"the first of chained exceptions; the last was {last.text[:160]!r}"
                             f" (line {last.line_no})")]
                            if best is not last and last.category is not best.category else [])
                    per_rank[rank] = dataclasses.replace(best, phase=phase, notes=[*best.notes, *note])
        if per_rank:
            return min(per_rank.values(), key=lambda f: (f.line_no, f.seq))
    return None


def _pick_hint(active: list[Finding]) -> Finding | None:
    hints = [f for f in active if not f.structural]
    first = _pick(hints, ROOT)
    # A watchdog timeout explains the comm aborts printed around it (before it, too).
    comm = _pick([f for f in hints if f.rule == "nccl_timeout"], COMM) or _pick(hints, COMM)
    if first is None:
        # An abort/segfault marker is how a comm failure ends a rank, not a cause beside it.
        crash = _pick([f for f in hints if comm is None or f.rule not in ("abort", "segfault", "bus_error")], CRASH)
        later = [f for f in (comm, crash) if f is not None]
        first = min(later, key=lambda f: (f.line_no, f.seq)) if later else None
    return first or _pick(hints, HINT)


def _hint_diagnosis(hint: Finding, state: ScanState) -> Diagnosis:
    """A verdict from text alone: strength "hint"; a category the policy would end the job or
    pause the queue on becomes crash_other (a retry), the text kept as detail."""
    root = _root_of(hint)
    note = " (from text printed outside an exception that ended a traceback: weaker evidence"
    if hint.category in TERMINAL:
        note += f"; not treated as {hint.category.value}"
        root.hit = Hit(hint.hit.rule, Category.CRASH_OTHER, hint.hit.tier, hint.hit.subkind, exc=hint.hit.exc,
                       numbers=dict(hint.hit.numbers), vendor=hint.hit.vendor)
    return diagnosis_of(root, state, note + ")", strength="hint")


def _launch_failure(state: ScanState, exit: ExitRecord | None) -> Diagnosis | None:
    """The command never started (the shim's exec failed): not the training's fault, nor a crash."""
    if exit is None:
        return None
    line = next((f for f in state.findings if f.rule == "launch_failed"), None)
    if not exit.launch_error and not (exit.returncode == 127 and line is not None):
        return None
    what = (exit.launch_error or (line.text if line else "")).strip()
    what = what.split("oom-supervisor: ", 1)[-1]
    ev = (line.evidence(),) if line is not None else ()
    return dataclasses.replace(
        plain(Category.CONFIG_ERROR, "launch_failed", f"could not start: {what}", state, ev, phase=Phase.UNKNOWN),
        numbers={"returncode": exit.returncode} if exit.returncode is not None else {})


def _confirm_disk(root: Root, host: HostEvidence | None, state: ScanState) -> tuple[Root, Diagnosis | None]:
    """Disk full needs the file system to agree when statvfs was measured (a quota is not visible there)."""
    if host is None or not host.free_bytes or root.hit.subkind == "quota":
        return root, None
    full = {p: b for p, b in host.free_bytes.items() if b < NEAR_FULL_BYTES}
    if full:
        root.notes.append("statvfs: " + ", ".join(f"{p} has {human(b)} free" for p, b in sorted(full.items())))
        return root, None
    free = ", ".join(f"{p} has {human(b)} free" for p, b in sorted(host.free_bytes.items()))
    root.hit = Hit(root.hit.rule, Category.CRASH_OTHER, root.hit.tier, root.hit.subkind, exc=root.hit.exc)
    root.notes.append(f"the log says the disk is full but statvfs disagrees ({free}); not treated as disk_full")
    return root, diagnosis_of(root, state, strength="hint")


def _choose(candidates: list[Root], host_root: Root | None, kernel_root: Root | None = None) -> Root | None:
    """Earliest tier-1 cause; a corroborated OOM kill counts as tier 1 at its kill line; a device fault
    the kernel reported counts as tier 1 without a line (after any line-located tier-1 cause)."""
    tier1 = [c for c in candidates if c.hit.tier == ROOT]
    if host_root is not None:
        tier1.append(host_root)
    if kernel_root is not None:
        tier1.append(kernel_root)
    if tier1:
        # A cause without a line (host evidence, loss-scale count) sorts after lines: it is
        # known only at the end, so any earlier line-located root cause explains more.
        best = min(tier1, key=lambda c: (c.line_no == 0, c.line_no))
        if kernel_root is not None and best is not kernel_root and best.hit.category is Category.DEVICE_FAULT:
            # The log says a device failed; the kernel says how (Xid 79: off the bus).
            kernel_root.extra.insert(0, Evidence(line_no=best.line_no, text=best.text, rule=best.hit.rule))
            kernel_root.rank, kernel_root.phase = best.rank, best.phase
            return kernel_root
        return best
    rest = [c for c in candidates if c.hit.tier in (COMM, CRASH)]
    return min(rest, key=lambda c: c.line_no) if rest else None
