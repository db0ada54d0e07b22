"""Retention of quarantined and archived checkpoints: real folders, real moves, real removal."""

from __future__ import annotations

import json
import os
from pathlib import Path

from supervisor.judge.policy import parse_policy_text
from supervisor.judge.resume import ARCHIVE_DIR, Aside, Fixup, plan_retention
from supervisor.run.checkpoints import (
    QUARANTINE_DIR,
    apply_fixups,
    list_asides,
    quarantine,
    reclaim,
    scan_output_dir,
)

PLAIN = ["config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"]


def make(out: Path, step: int, complete: bool = True) -> Path:
    d = out / f"checkpoint-{step}"
    d.mkdir(parents=True)
    for f in PLAIN:
        (d / f).write_bytes(b"x" * 1000)
    if complete:
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return d


def age(path: Path, t: float) -> None:
    os.utime(path, (t, t))


def test_old_quarantined_and_archived_folders_are_reclaimed(tmp_path):
    out = tmp_path / "out"
    for i, step in enumerate((5, 10, 15, 20)):  # four crashes mid-save, quarantined in turn
        make(out, step, complete=False)
        (inc,) = scan_output_dir(out).incomplete
        age(quarantine(inc, now=1000 + i), 1000 + i)
    for i in range(3):  # three restarts that archived their checkpoints
        make(out, 30 + i)
        apply_fixups_archive(out, f"attempt-{i}")
        age(out / ARCHIVE_DIR / f"attempt-{i}", 2000 + i)
    make(out, 40)  # a live complete checkpoint
    removed = reclaim(out, keep_quarantined=2, keep_archived=1)
    gone = sorted(r.aside.path.name for r in removed)
    assert len([r for r in removed if r.aside.kind == "quarantined"]) == 2
    left_q = sorted(p.name.split(".")[0] for p in (out / QUARANTINE_DIR).iterdir())
    assert left_q == ["checkpoint-15", "checkpoint-20"]  # the newest two
    assert sorted(p.name for p in (out / ARCHIVE_DIR).iterdir()) == ["attempt-2"]
    assert "attempt-0" in gone and "attempt-1" in gone
    assert all(r.describe().startswith("removed ") and "GiB" in r.describe() for r in removed)
    assert (out / "checkpoint-40" / "trainer_state.json").exists()


def test_the_only_complete_checkpoint_is_never_reclaimed(tmp_path):
    out = tmp_path / "out"
    make(out, 30)
    apply_fixups_archive(out, "attempt-0")
    age(out / ARCHIVE_DIR / "attempt-0", 2000)
    (out / ARCHIVE_DIR / "attempt-1").mkdir()  # a newer archive holding nothing complete
    age(out / ARCHIVE_DIR / "attempt-1", 3000)
    removed = reclaim(out, keep_quarantined=0, keep_archived=0)
    assert [r.aside.path.name for r in removed] == ["attempt-1"]
    assert (out / ARCHIVE_DIR / "attempt-0" / "checkpoint-30" / "trainer_state.json").exists()


def test_plan_retention_is_pure_and_keeps_the_newest():
    a = [Aside(Path(f"/o/q{i}"), "quarantined", float(i)) for i in range(4)]
    r = plan_retention(a, live_complete=1, keep_quarantined=3, keep_archived=0)
    assert [x.aside.path.name for x in r] == ["q0"]
    assert plan_retention(a, live_complete=1, keep_quarantined=10, keep_archived=0) == []


def test_list_asides_sees_both_kinds(tmp_path):
    out = tmp_path / "out"
    make(out, 3, complete=False)
    quarantine(scan_output_dir(out).incomplete[0])
    make(out, 6)
    apply_fixups_archive(out, "attempt-2")
    kinds = sorted((a.kind, a.complete_steps) for a in list_asides(out))
    assert kinds == [("archived", (6,)), ("quarantined", ())]


def test_policy_names_the_retention():
    p = parse_policy_text("name: x\nladder: [allocator]\nretention: {keep_quarantined: 1, keep_archived: 3}\n")
    assert (p.retention.keep_quarantined, p.retention.keep_archived) == (1, 3)


def apply_fixups_archive(out: Path, name: str) -> None:
    from supervisor.judge.resume import ResumePlan

    apply_fixups(ResumePlan("restart", None, {}, "test",
                            fixups=(Fixup("archive_checkpoints", out, target=out / ARCHIVE_DIR / name),)))
