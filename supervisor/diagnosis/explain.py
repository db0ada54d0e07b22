"""`oom-supervisor explain LOGFILE`: say why an attempt failed, from its log.

The integrator wires `configure`/`run` into supervisor/cli.py as a subcommand.
Exit codes: 0 diagnosed (whatever the category), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import signal as _signal
import sys
from typing import TextIO

from supervisor.diagnosis import diagnose_file
from supervisor.diagnosis.sizes import human
from supervisor.models import Diagnosis, ExitRecord


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logfile", metavar="LOGFILE", help="combined stdout/stderr log of one attempt")
    parser.add_argument("--exit-code", type=int, default=None, metavar="N",
                        help="the attempt's exit status (negative = killed by that signal; 137 = SIGKILL)")
    parser.add_argument("--signal", default=None, metavar="NAME", help="signal that ended it (e.g. SIGKILL, KILL, 9)")
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
    exit = None
    if args.exit_code is not None or sig is not None:
        rc = args.exit_code
        if rc is None and sig is not None:
            rc = -int(_signal.Signals[sig])
        exit = ExitRecord(returncode=rc, signal=sig)
    try:
        diagnosis = diagnose_file(args.logfile, exit)
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


def _fmt_number(key: str, value: object) -> str:
    if isinstance(value, int) and key not in ("device_index", "timeout_ms"):
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
    lines.append(f"summary  : {d.summary}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oom-supervisor explain", description=__doc__.splitlines()[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
