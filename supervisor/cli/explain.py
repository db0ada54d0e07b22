"""`oom-supervisor explain LOGFILE`: say why an attempt failed, from its log and the evidence a user has.

Besides the log: the exit status or signal, a kernel log excerpt (dmesg), the cgroup's OOM-kill
counter, the batch scheduler's state (Slurm) and the free space of folders (statvfs): they feed
the same ExitRecord/HostEvidence the daemon gathers, so a past run is judged by the same rules.
Exit codes: 0 diagnosed (whatever the category), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import signal as _signal
import sys
from typing import TextIO

from supervisor.core.models import Diagnosis, ExitRecord, HostEvidence
from supervisor.judge.diagnosis import diagnose_file
from supervisor.judge.diagnosis.kernel import RELEVANT_RE
from supervisor.judge.diagnosis.sizes import human, parse_size

SCHEDULER_STATES = ("OUT_OF_MEMORY", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "CANCELLED", "FAILED", "COMPLETED",
                    "DEADLINE", "BOOT_FAIL")
KERNEL_LOG_MAX_BYTES = 64 << 20


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logfile", metavar="LOGFILE", help="combined stdout/stderr log of one attempt")
    parser.add_argument("--exit-code", type=int, default=None, metavar="N",
                        help="the attempt's exit status (negative = killed by that signal; 137 = SIGKILL)")
    parser.add_argument("--signal", default=None, metavar="NAME", help="signal that ended it (e.g. SIGKILL, KILL, 9)")
    parser.add_argument("--kernel-log", default=None, metavar="FILE",
                        help="a kernel log excerpt (dmesg / journalctl -k) from around the failure: OOM kills,"
                             " GPU driver faults (NVRM Xid, amdgpu), PCIe AER errors")
    parser.add_argument("--cgroup-oom-kills", type=int, default=None, metavar="N",
                        help="the job cgroup's oom_kill counter (memory.events)")
    parser.add_argument("--slurm-state", default=None, metavar="STATE",
                        help="the scheduler's job state: " + ", ".join(SCHEDULER_STATES[:5]))
    parser.add_argument("--free-bytes", action="append", default=[], metavar="PATH=N",
                        help="free space of a folder the job wrote (bytes, or a size like 3GiB); repeatable")
    parser.add_argument("--json", action="store_true", help="print one JSON object (Diagnosis.to_dict())")


def _signal_name(value: str) -> str | None:
    v = value.strip().upper()
    if v.isdigit():
        try:
            return _signal.Signals(int(v)).name
        except ValueError:
            return None
    name = v if v.startswith("SIG") else "SIG" + v
    return name if name in _signal.Signals.__members__ else None


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    sig = None
    if args.signal is not None:
        sig = _signal_name(args.signal)
        if sig is None:
            print(f"error: unknown signal {args.signal!r} (use a name like SIGKILL or a number)", file=err)
            return 2
    host, problem = _host_evidence(args)
    if problem:
        print(f"error: {problem}", file=err)
        return 2
    exit = None
    if args.exit_code is not None or sig is not None:
        rc = args.exit_code
        if rc is None and sig is not None:
            rc = -int(_signal.Signals[sig])
        exit = ExitRecord(returncode=rc, signal=sig)
    try:
        diagnosis = diagnose_file(args.logfile, exit, host)
    except FileNotFoundError:
        print(f"error: log file not found: {args.logfile}", file=err)
        return 2
    except IsADirectoryError:
        print(f"error: {args.logfile} is a directory, not a log file", file=err)
        return 2
    except PermissionError:
        print(f"error: cannot read {args.logfile}: permission denied", file=err)
        return 2
    if args.json:
        print(json.dumps(diagnosis.to_dict(), sort_keys=True), file=out)
    else:
        out.write(render(diagnosis))
    return 0


def _host_evidence(args: argparse.Namespace) -> tuple[HostEvidence | None, str | None]:
    """HostEvidence from the flags, or a message saying precisely which flag is wrong."""
    kills = getattr(args, "cgroup_oom_kills", None)
    if kills is not None and kills < 0:
        return None, f"--cgroup-oom-kills must be >= 0, got {kills}"
    state = getattr(args, "slurm_state", None)
    if state is not None:
        state = state.strip().upper().split()[0] if state.strip() else ""  # "CANCELLED by 1000" -> CANCELLED
        if state not in SCHEDULER_STATES:
            return None, f"unknown --slurm-state {args.slurm_state!r} (one of {', '.join(SCHEDULER_STATES)})"
    free: dict[str, int] = {}
    for item in getattr(args, "free_bytes", None) or ():
        path, eq, value = item.rpartition("=")
        if not eq or not path:
            return None, f"--free-bytes wants PATH=BYTES, got {item!r}"
        n = int(value) if value.strip().isdigit() else parse_size(value.strip())
        if n is None:
            return None, f"--free-bytes {item}: {value!r} is not a size (bytes, or e.g. 3GiB)"
        free[path] = n
    lines: tuple[str, ...] = ()
    klog = getattr(args, "kernel_log", None)
    if klog is not None:
        try:
            with open(klog, "rb") as fh:
                text = fh.read(KERNEL_LOG_MAX_BYTES).decode("utf-8", "replace")
        except FileNotFoundError:
            return None, f"kernel log not found: {klog}"
        except IsADirectoryError:
            return None, f"--kernel-log {klog} is a directory, not a file"
        except PermissionError:
            return None, f"cannot read the kernel log {klog}: permission denied"
        lines = tuple(line for line in text.splitlines() if RELEVANT_RE.search(line))
    if kills is None and state is None and not free and klog is None:
        return None, None
    return HostEvidence(cgroup_oom_kills=kills, kernel_lines=lines, kernel_log_read=True if klog else None,
                        free_bytes=free, scheduler_state=state), None


def _fmt_number(key: str, value: object) -> str:
    if isinstance(value, int) and key not in ("device_index", "timeout_ms", "held_by_others_inferred", "scanner_errors"):
        return f"{human(value)} ({value:,} bytes)"
    return str(value)


def render(d: Diagnosis) -> str:
    """Plain-text report a person reads in the morning."""
    lines = [
        f"category : {d.category.value}",
        f"subkind  : {d.subkind or '-'}",
        f"vendor   : {d.vendor}",
        f"phase    : {d.phase.value}",
        f"rank     : {d.rank if d.rank is not None else '-'}",
    ]
    if d.numbers:
        lines.append("numbers  :")
        for k, v in d.numbers.items():
            lines.append(f"  {k:<22} {_fmt_number(k, v)}")
    if d.category.value == "gpu_oom":
        lines.append(f"fragmentation: {'yes' if d.fragmentation else 'no'}")
    if d.evidence:
        lines.append("evidence :")
        for e in d.evidence:
            where = f"line {e.line_no}" if e.line_no else "host"
            text = e.text if len(e.text) <= 300 else e.text[:300] + "..."
            lines.append(f"  {where:>11} [{e.rule}] {text}")
    lines.append(f"strength : {d.strength}")
    lines.append(f"summary  : {d.summary}")
    if d.category.value == "unknown" and d.candidates:
        # Nothing is certain: the two likeliest causes and where the log points to each.
        lines.append("why not  : nothing decides; most likely, and where to look:")
        for c in d.candidates:
            lines.append(f"  {c.category.value}")
            lines += [f"  {f'line {n}':>11} {t if len(t) <= 300 else t[:300] + '...'}" for n, t in c.lines]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oom-supervisor explain", description=__doc__.splitlines()[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
