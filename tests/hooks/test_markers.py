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


def test_a_replica_save_says_which_rank_wrote_it_and_whose_rng_it_holds():
    lines = [("[rank1]: oom-supervisor: emergency checkpoint: saving step 7 to /o/checkpoint-7 (after a CPU-allocator "
             "OOM on rank 1 of 2; gradients dropped, caches emptied: resident memory 700 MiB -> 690 MiB)"),
             ("oom-supervisor: emergency checkpoint: replica of rank 1 of 2: model, optimizer, scheduler and trainer "
             "state from rank 1; RNG from ranks [0, 1]"),
             "oom-supervisor: emergency checkpoint at step 7: /o/checkpoint-7 (saved in 1.3 s)", *TRACEBACK]
    got = parse_emergency(lines)
    assert (got.outcome, got.step, got.rank, got.world_size, got.rng_ranks) == ("saved", 7, 1, 2, (0, 1))
    # A second failing rank that leaves the save to the first is no outcome of its own.
    later = parse_emergency([*lines, ("oom-supervisor: emergency checkpoint: rank 0 of 2 leaves the save of step 7 "
                             "to the rank that claimed it first")])
    assert later.outcome == "saved" and later.rank == 1
    # One process: no rank fields.
    assert parse_emergency([SAVED]).rank is None and parse_emergency([SAVED]).rng_ranks == ()
