"""parse_emergency() on the lines the hook really prints (copied from the real runs in this folder)."""

from __future__ import annotations

from supervisor.hooks.markers import parse_emergency

SAVING = ("oom-supervisor: emergency checkpoint: saving step 8 to /w/out dir/checkpoint-8 (after a CPU-allocator "
          "OOM; gradients dropped, caches emptied: resident memory 1812 MiB -> 903 MiB)")
SAVED = "oom-supervisor: emergency checkpoint at step 8: /w/out dir/checkpoint-8 (saved in 0.4 s)"
TRACEBACK = ["Traceback (most recent call last):", "RuntimeError: ... DefaultCPUAllocator: can't allocate memory"]


def test_saved_with_its_path_time_and_line():
    got = parse_emergency(["{'loss': 6.5}", SAVING, "Saving model checkpoint to /w/out dir/tmp-checkpoint-8/checkpoint-8",
                           SAVED, *TRACEBACK])
    assert (got.outcome, got.step, got.path, got.seconds, got.line_no) == ("saved", 8, "/w/out dir/checkpoint-8", 0.4, 4)
    assert got.steps_saved and got.text == SAVED


def test_a_save_without_a_result_line_was_interrupted():
    got = parse_emergency([SAVING + "\n"])
    assert got.outcome == "interrupted" and got.step == 8 and not got.steps_saved


def test_already_saved_failed_not_attempted_and_moved_aside():
    already = parse_emergency([("oom-supervisor: emergency checkpoint at step 5: /o/checkpoint-5 "
                                "(already saved by the regular schedule)")])
    assert (already.outcome, already.step, already.path) == ("already_saved", 5, "/o/checkpoint-5")
    failed = parse_emergency([SAVING, ("oom-supervisor: emergency checkpoint at step 8 failed: RuntimeError: "
                               "PytorchStreamWriter failed writing file data/0: file write failed")])
    assert failed.outcome == "failed" and failed.step == 8 and "file write failed" in failed.reason
    rank = parse_emergency([("oom-supervisor: no emergency checkpoint: a GPU OOM on rank 1 of 2; the other ranks "
                             "wait in a collective this rank will not join, ...")])
    assert rank.outcome == "not_attempted" and "rank 1 of 2" in rank.reason
    moved = parse_emergency([("oom-supervisor: emergency checkpoint: moved the incomplete /o/checkpoint-5 (a regular "
                              "save the OOM interrupted) to /o/.supervisor-quarantine/checkpoint-5.incomplete-X"),
                             SAVED.replace("8", "5")])
    assert moved.outcome == "saved" and moved.moved_aside == "/o/.supervisor-quarantine/checkpoint-5.incomplete-X"


def test_rank_prefixes_and_carriage_returns_are_read_and_nothing_else_is():
    assert parse_emergency(["[rank0]: " + SAVED]).outcome == "saved"
    assert parse_emergency(["50%|#####     | 4/8\r" + SAVED]).outcome == "saved"
    assert parse_emergency(["a sample that mentions oom-supervisor: in its text", *TRACEBACK]) is None
    assert parse_emergency([]) is None
