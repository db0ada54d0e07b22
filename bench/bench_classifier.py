"""Classifier benchmark: the diagnosis over every labeled fixture log, per category.

    python bench/bench_classifier.py                  # all fixtures: tests/fixtures/logs/**.expect.yaml
    python bench/bench_classifier.py --code /tmp/old  # the same fixtures judged by another checkout's code
    python bench/bench_classifier.py --only real -v   # the real-log set only, each miss with its summary

A fixture is `<name>.log` + `<name>.expect.yaml` (`expect: {category: ...}`, optional `exit:`,
`host:`, `kernel_log: FILE` beside it, `source:` for real logs). Printed: accuracy per category
(by the label), overall accuracy, GPU-OOM recall (gpu_oom labels diagnosed gpu_oom), false OOMs
(a gpu_oom or host_oom verdict on a fixture labeled neither), the confusion matrix (rows: label,
columns: verdict) and every miss. Targets (issue 16): accuracy >= 0.92, GPU-OOM recall 1.00,
0 false OOMs. `--code` puts another tree first on sys.path (e.g. a `git worktree` of the branch's
start), so before/after figures come from the same fixtures and the same counting.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "logs"


def load(sidecar: Path, HostEvidence: Any, ExitRecord: Any) -> tuple[bytes, dict[str, Any], Any, Any]:
    import yaml

    side = yaml.safe_load(sidecar.read_text())
    log = sidecar.with_name(sidecar.name.replace(".expect.yaml", ".log")).read_bytes()
    exit = ExitRecord(**side["exit"]) if side.get("exit") else None
    fields = {f.name for f in dataclasses.fields(HostEvidence)}
    lines_field = "kernel_lines" if "kernel_lines" in fields else "kernel_oom_lines"
    h: dict[str, Any] = dict(side.get("host") or {})
    for key in ("kernel_lines", "kernel_oom_lines"):
        if key in h:
            h[lines_field] = tuple(h.pop(key))
    if side.get("kernel_log"):
        text = (sidecar.parent / side["kernel_log"]).read_text(errors="replace")
        h[lines_field] = tuple(h.get(lines_field, ())) + tuple(text.splitlines())
        if "kernel_log_read" in fields:
            h.setdefault("kernel_log_read", True)
    h = {k: v for k, v in h.items() if k in fields}
    host = HostEvidence(**h) if h else None
    return log, side, exit, host


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--code", default=None, help="a checkout whose supervisor package judges the fixtures")
    ap.add_argument("--fixtures", default=str(FIXTURES), help="fixture folder (searched recursively)")
    ap.add_argument("--only", choices=["real", "synthetic"], default=None, help="a subset of the fixtures")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each miss's summary")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the tables")
    args = ap.parse_args(argv)
    code = Path(args.code).resolve() if args.code else REPO
    sys.path.insert(0, str(code))
    # An editable install's finder would answer `import supervisor` before sys.path is searched.
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
    import supervisor

    if not Path(supervisor.__file__).resolve().is_relative_to(code):
        sys.exit(f"bench_classifier: imported supervisor from {supervisor.__file__}, not from {code}")
    try:
        from supervisor.core.models import ExitRecord, HostEvidence
        from supervisor.judge.diagnosis import diagnose_bytes
    except ImportError:  # a tree from before the layout by layer (e7308bd and older)
        from supervisor.diagnosis import diagnose_bytes
        from supervisor.models import ExitRecord, HostEvidence

    cases = sorted(Path(args.fixtures).rglob("*.expect.yaml"))
    if args.only == "real":
        cases = [c for c in cases if c.parent.name == "real"]
    elif args.only == "synthetic":
        cases = [c for c in cases if c.parent.name != "real"]
    confusion: dict[str, Counter[str]] = defaultdict(Counter)
    misses: list[tuple[str, str, str, str]] = []
    unreadable: list[str] = []
    for case in cases:
        try:
            log, side, exit, host = load(case, HostEvidence, ExitRecord)
        except Exception as exc:  # noqa: BLE001 - a broken sidecar is reported, not fatal
            unreadable.append(f"{case.name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        want = side["expect"]["category"]
        d = diagnose_bytes(log, exit, host)
        got = d.category.value
        confusion[want][got] += 1
        if got != want:
            misses.append((case.name.replace(".expect.yaml", ""), want, got, d.summary))

    total = sum(sum(c.values()) for c in confusion.values())
    right = sum(confusion[k][k] for k in confusion)
    oom = ("gpu_oom", "host_oom")
    gpu_total = sum(confusion["gpu_oom"].values())
    gpu_recall = confusion["gpu_oom"]["gpu_oom"] / gpu_total if gpu_total else 1.0
    false_gpu = sum(c["gpu_oom"] for k, c in confusion.items() if k != "gpu_oom")
    false_oom = sum(c[o] for k, c in confusion.items() if k not in oom for o in oom)
    per = {k: (confusion[k][k], sum(confusion[k].values())) for k in sorted(confusion)}
    result = {"fixtures": total, "accuracy": right / total if total else 0.0, "gpu_oom_recall": gpu_recall,
              "false_gpu_ooms": false_gpu, "false_ooms": false_oom,
              "per_category": {k: {"right": r, "total": n} for k, (r, n) in per.items()},
              "confusion": {k: dict(v) for k, v in confusion.items()},
              "misses": [{"case": m[0], "label": m[1], "verdict": m[2]} for m in misses],
              "unreadable": unreadable}
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    print(f"fixtures        : {total} ({args.fixtures}{', ' + args.only if args.only else ''})")
    print(f"code            : {args.code or REPO}")
    print("per category    : label            right/total  accuracy")
    for k, (r, n) in per.items():
        print(f"                  {k:<16} {r:>5}/{n:<5}  {r / n:.2f}")
    print(f"accuracy        : {result['accuracy']:.3f} ({right}/{total}; target >= 0.92)")
    print(f"GPU-OOM recall  : {gpu_recall:.3f} ({confusion['gpu_oom']['gpu_oom']}/{gpu_total}; target 1.00)")
    print(f"false OOMs      : {false_oom} (a gpu_oom/host_oom verdict on another label; {false_gpu} of them gpu_oom;"
          " target 0)")
    cols = sorted({g for c in confusion.values() for g in c} | set(confusion))
    short = {c: c.replace("_failure", "").replace("_error", "").replace("_fault", "")[:8] for c in cols}
    print("confusion (rows: label, columns: verdict)")
    print(" " * 16 + " ".join(f"{short[c]:>8}" for c in cols))
    for k in cols:
        if k in confusion:
            print(f"{k:<16}" + " ".join(f"{confusion[k][c] or '.':>8}" for c in cols))
    for u in unreadable:
        print(f"unreadable fixture (skipped): {u}")
    if misses:
        print(f"misses ({len(misses)}):")
        for name, want, got, summary in misses:
            print(f"  {name}: {want} -> {got}" + (f"\n      {summary[:300]}" if args.verbose else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
