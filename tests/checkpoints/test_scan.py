"""Completeness rules on checkpoint layouts copied from real runs (names only; contents faked).

The layouts are what transformers 5.6 + DeepSpeed 0.19.8 wrote here (see test_real_*); multi-rank
ones extend them by rank the way transformers/DeepSpeed name files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.judge.resume import ARCHIVE_DIR, Fixup, Incomplete, ResumePlan
from supervisor.run.checkpoints import QUARANTINE_DIR, apply_fixups, quarantine, scan_output_dir

PLAIN = ["config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth",
         "training_args.bin", "tokenizer.json"]


def make(out: Path, step: int, files: list[str], *, state: object = "ok", tag_files: list[str] = (),
         latest: str | None = None) -> Path:
    d = out / f"checkpoint-{step}"
    d.mkdir(parents=True)
    for f in files:
        (d / f).write_bytes(b"x")
    if state == "ok":
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "train_batch_size": 4}))
    elif isinstance(state, str):
        (d / "trainer_state.json").write_text(state)
    if tag_files:
        tag = d / f"global_step{step}"
        tag.mkdir()
        for f in tag_files:
            (tag / f).write_bytes(b"x")
    if latest is not None:
        (d / "latest").write_text(latest)
    return d


def zero3(ranks: range) -> list[str]:
    return [f for r in ranks for f in (f"zero_pp_rank_{r}_mp_rank_00_model_states.pt",
                                       f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")]


def test_plain_and_broken_layouts(tmp_path):
    make(tmp_path, 3, PLAIN)
    make(tmp_path, 6, PLAIN, state=None)                       # killed before the state was written
    make(tmp_path, 9, PLAIN, state='{"global_step": 9, "log_hi')  # truncated
    make(tmp_path, 12, PLAIN, state='{"global_step": 11}')        # not this folder's state
    make(tmp_path, 15, ["model.safetensors.index.json", "model-00001-of-00002.safetensors", *PLAIN[2:]])
    (tmp_path / "checkpoint-15" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (tmp_path / "checkpoint-x").mkdir()      # not a checkpoint name: ignored, like transformers does
    (tmp_path / "checkpoint-18").write_text("")  # a file, not a folder: ignored
    scan = scan_output_dir(tmp_path)
    assert [c.step for c in scan.complete] == [3]
    reasons = {i.step: i.reason for i in scan.incomplete}
    assert set(reasons) == {6, 9, 12, 15}
    assert "no trainer_state.json" in reasons[6]
    assert "unreadable" in reasons[9]
    assert "global_step 11" in reasons[12]
    assert "model-00002-of-00002.safetensors" in reasons[15]
    assert scan.latest.step == 3


def test_every_rank_must_have_written_its_rng_state(tmp_path):
    base = [f for f in PLAIN if f != "rng_state.pth"]
    make(tmp_path, 2, [*base, "rng_state_0.pth", "rng_state_1.pth"])
    make(tmp_path, 4, [*base, "rng_state_0.pth", "rng_state_2.pth"])  # rank 1 died before its save
    scan = scan_output_dir(tmp_path)
    assert [c.step for c in scan.complete] == [2] and scan.complete[0].world_size == 2
    assert "ranks [1]" in scan.incomplete[0].reason
    # Knowing the run had 4 ranks makes the check strict even where the files look consistent.
    strict = scan_output_dir(tmp_path, expected_world_size=4)
    assert strict.complete == () and "ranks [2, 3]" in strict.incomplete[0].reason


def test_deepspeed_zero3_layouts(tmp_path):
    root = ["config.json", "model.safetensors", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"]
    make(tmp_path, 2, root, tag_files=zero3(range(2)), latest="global_step2")
    make(tmp_path, 4, root, tag_files=zero3(range(2)))                           # `latest` not yet written
    make(tmp_path, 6, root, tag_files=zero3(range(2)), latest="global_step5")    # names a missing tag
    make(tmp_path, 8, root, tag_files=zero3(range(1)), latest="global_step8")    # rank 1 shards missing
    make(tmp_path, 10, root[:3], tag_files=["mp_rank_00_model_states.pt",
                                             "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"],
         latest="global_step10")                                                  # ZeRO-2, one rank
    scan = scan_output_dir(tmp_path)
    ck = {c.step: c for c in scan.complete}
    assert set(ck) == {2, 10}
    assert (ck[2].zero_stage, ck[2].world_size, ck[2].ds_tag) == (3, 2, "global_step2")
    assert (ck[10].zero_stage, ck[10].world_size) == (2, 1)
    reasons = {i.step: i.reason for i in scan.incomplete}
    assert "without `latest`" in reasons[4]
    assert "global_step5" in reasons[6]
    assert "shards missing for ranks [1]" in reasons[8]


def test_quarantine_moves_out_of_transformers_sight_and_never_overwrites(tmp_path):
    d = make(tmp_path, 6, PLAIN, state=None)
    (d / "marker").write_text("keep me")
    first = quarantine(Incomplete(d, 6, "no state"), now=0)
    d2 = make(tmp_path, 6, PLAIN, state=None)
    second = quarantine(Incomplete(d2, 6, "no state"), now=0)  # same second: a distinct name
    assert first != second and first.parent == second.parent == tmp_path / QUARANTINE_DIR
    assert (first / "marker").read_text() == "keep me"
    assert first.name.startswith("checkpoint-6.incomplete-19700101T000000Z")
    assert not list(tmp_path.glob("checkpoint-*"))  # the rotation glob and auto-resume see nothing


def test_archive_moves_checkpoints_and_final_weights_and_refuses_to_merge(tmp_path):
    make(tmp_path, 3, PLAIN)
    make(tmp_path, 6, PLAIN)
    (tmp_path / "model.safetensors").write_bytes(b"final")
    (tmp_path / "trainer_log.jsonl").write_text("{}\n")
    target = tmp_path / ARCHIVE_DIR / "a1"
    plan = ResumePlan("restart", None, {}, "test", fixups=(Fixup("archive_checkpoints", tmp_path, target=target),))
    done = apply_fixups(plan)
    assert len(done) == 3
    assert sorted(p.name for p in target.iterdir()) == ["checkpoint-3", "checkpoint-6", "final-weights"]
    assert (tmp_path / "trainer_log.jsonl").exists()  # the log stays: progress history
    make(tmp_path, 3, PLAIN)
    with pytest.raises(FileExistsError):
        apply_fixups(plan)
    assert (tmp_path / "checkpoint-3").is_dir()  # nothing lost either way
