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
import hashlib
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
    ap.add_argument("--part", choices=["both", "dev", "heldout", "all"], default="both",
                    help="a corpus with source threads (bench/corpus) is scored per part: both side by side "
                         "(default), one of them, or all as one set")
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
    judged, unreadable = judge_all(cases, diagnose_bytes, HostEvidence, ExitRecord)
    split = args.part != "all" and any(j.thread for j in judged)
    if not split:
        result = {**score(judged), "unreadable": unreadable}
        if args.json:
            print(json.dumps(result, sort_keys=True))
            return 0
        print(f"fixtures        : {result['fixtures']} ({args.fixtures}{', ' + args.only if args.only else ''})")
        print(f"code            : {args.code or REPO}")
        print_result(result, verbose=args.verbose)
        print_unreadable(unreadable)
        return 0
    parts = {name: score([j for j in judged if part_of(j.thread) == name]) for name in PARTS}
    wanted = PARTS if args.part == "both" else (args.part,)
    out = {name: parts[name] for name in wanted}
    if args.part == "both":
        out["gap"] = parts["dev"]["accuracy"] - parts["heldout"]["accuracy"]
        out["corpus"] = corpus_shape(judged)
    out["unreadable"] = unreadable
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    print(f"corpus          : {args.fixtures}; code: {args.code or REPO}")
    if args.part == "both":
        shape = out["corpus"]
        print(f"                  {shape['excerpts']} excerpts, {shape['threads']} threads, "
              f"{shape['repositories']} repositories; held out: {shape['heldout_excerpts']} excerpts "
              f"({shape['heldout_fraction']:.0%}) from {shape['heldout_threads']} threads")
        print_side_by_side(parts)
    for name in wanted:
        print(f"\n=== {PART_NAMES[name]}")
        # A held-out miss is named only when asked (-v): a rule writer reading this output must not
        # learn which held-out excerpts to open. Its counts and confusion matrix are always shown.
        print_result(parts[name], verbose=args.verbose, repos=True, names=args.verbose or name != "heldout")
    print_unreadable(unreadable)
    return 0


PARTS = ("dev", "heldout")
PART_NAMES = {"dev": "development part (rules may be written from it)",
              "heldout": "held-out part (no rule is written from it; the figure the README reports)"}
HELDOUT_PERCENT = 35


def part_of(thread: str | None) -> str:
    """The corpus is split once, by source thread, by a hash nobody chooses: a thread's excerpts
    always fall together, adding excerpts never moves an old one, and about 35% is held out."""
    key = (thread or "").strip().lower().encode()
    return "heldout" if int(hashlib.sha256(key).hexdigest()[:8], 16) % 100 < HELDOUT_PERCENT else "dev"


@dataclasses.dataclass(frozen=True)
class Judged:
    name: str
    label: str
    verdict: str
    summary: str
    thread: str | None

    @property
    def repo(self) -> str:
        return (self.thread or "?").split("#")[0].lower()  # GitHub names are case-insensitive


def judge_all(cases: list[Path], diagnose_bytes: Any, HostEvidence: Any, ExitRecord: Any
              ) -> tuple[list[Judged], list[str]]:
    judged: list[Judged] = []
    unreadable: list[str] = []
    for case in cases:
        try:
            log, side, exit, host = load(case, HostEvidence, ExitRecord)
        except Exception as exc:  # noqa: BLE001 - a broken sidecar is reported, not fatal
            unreadable.append(f"{case.name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        d = diagnose_bytes(log, exit, host)
        judged.append(Judged(case.name.replace(".expect.yaml", ""), side["expect"]["category"],
                             d.category.value, d.summary, side.get("thread")))
    return judged, unreadable


def score(judged: list[Judged]) -> dict[str, Any]:
    confusion: dict[str, Counter[str]] = defaultdict(Counter)
    repos: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for j in judged:
        confusion[j.label][j.verdict] += 1
        repos[j.repo][0] += j.label == j.verdict
        repos[j.repo][1] += 1
    total = len(judged)
    right = sum(confusion[k][k] for k in confusion)
    oom = ("gpu_oom", "host_oom")
    gpu_total = sum(confusion["gpu_oom"].values())
    per = {k: (confusion[k][k], sum(confusion[k].values())) for k in sorted(confusion)}
    return {"fixtures": total, "accuracy": right / total if total else 0.0,
            "gpu_oom_recall": confusion["gpu_oom"]["gpu_oom"] / gpu_total if gpu_total else 1.0,
            "gpu_oom_right": confusion["gpu_oom"]["gpu_oom"], "gpu_oom_total": gpu_total,
            "false_gpu_ooms": sum(c["gpu_oom"] for k, c in confusion.items() if k != "gpu_oom"),
            "false_ooms": sum(c[o] for k, c in confusion.items() if k not in oom for o in oom),
            "per_category": {k: {"right": r, "total": n} for k, (r, n) in per.items()},
            "per_repository": {k: {"right": r, "total": n} for k, (r, n) in sorted(repos.items())},
            "confusion": {k: dict(v) for k, v in confusion.items()},
            "misses": [{"case": j.name, "label": j.label, "verdict": j.verdict, "summary": j.summary}
                       for j in judged if j.label != j.verdict]}


def corpus_shape(judged: list[Judged]) -> dict[str, Any]:
    held = [j for j in judged if part_of(j.thread) == "heldout"]
    return {"excerpts": len(judged), "threads": len({j.thread for j in judged}),
            "repositories": len({j.repo for j in judged}),
            "heldout_excerpts": len(held), "heldout_threads": len({j.thread for j in held}),
            "heldout_fraction": len(held) / len(judged) if judged else 0.0,
            "per_category": dict(sorted(Counter(j.label for j in judged).items()))}


def print_side_by_side(parts: dict[str, dict[str, Any]]) -> None:
    dev, held = parts["dev"], parts["heldout"]
    print("                  development       held-out")
    for key, fmt in (("fixtures", "{}"), ("accuracy", "{:.3f}"), ("gpu_oom_recall", "{:.3f}"),
                     ("false_ooms", "{}")):
        print(f"{key:<16}: {fmt.format(dev[key]):<17} {fmt.format(held[key])}")
    print(f"gap             : {dev['accuracy'] - held['accuracy']:+.3f} (development minus held-out; target <= 0.03)")


def print_result(result: dict[str, Any], *, verbose: bool, repos: bool = False, names: bool = True) -> None:
    per = result["per_category"]
    print("per category    : label            right/total  accuracy")
    for k, v in per.items():
        print(f"                  {k:<16} {v['right']:>5}/{v['total']:<5}  {v['right'] / v['total']:.2f}")
    if repos:
        many = {k: v for k, v in result["per_repository"].items() if v["total"] >= 3 or verbose}
        rest = [v for k, v in result["per_repository"].items() if k not in many]
        print("per repository  : source (3 excerpts or more; all with -v)    right/total")
        for k, v in sorted(many.items(), key=lambda kv: -kv[1]["total"]):
            print(f"                  {k:<44} {v['right']:>3}/{v['total']:<3}")
        if rest:
            print(f"                  {f'({len(rest)} other repositories)':<44} "
                  f"{sum(v['right'] for v in rest):>3}/{sum(v['total'] for v in rest):<3}")
    print(f"accuracy        : {result['accuracy']:.3f} (target >= 0.92; held-out >= 0.95)")
    print(f"GPU-OOM recall  : {result['gpu_oom_recall']:.3f} ({result['gpu_oom_right']}/{result['gpu_oom_total']};"
          " target 1.00)")
    print(f"false OOMs      : {result['false_ooms']} (a gpu_oom/host_oom verdict on another label; "
          f"{result['false_gpu_ooms']} of them gpu_oom; target 0)")
    confusion = result["confusion"]
    cols = sorted({g for c in confusion.values() for g in c} | set(confusion))
    short = {c: c.replace("_failure", "").replace("_error", "").replace("_fault", "")[:8] for c in cols}
    print("confusion (rows: label, columns: verdict)")
    print(" " * 16 + " ".join(f"{short[c]:>8}" for c in cols))
    for k in cols:
        if k in confusion:
            print(f"{k:<16}" + " ".join(f"{confusion[k].get(c) or '.':>8}" for c in cols))
    misses = result["misses"]
    if misses and not names:
        print(f"misses ({len(misses)}): not named for the held-out part (-v names them)")
    elif misses:
        print(f"misses ({len(misses)}):")
        for m in misses:
            print(f"  {m['case']}: {m['label']} -> {m['verdict']}" + (f"\n      {m['summary'][:300]}" if verbose else ""))


def print_unreadable(unreadable: list[str]) -> None:
    for u in unreadable:
        print(f"unreadable fixture (skipped): {u}")


if __name__ == "__main__":
    raise SystemExit(main())
