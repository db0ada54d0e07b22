"""What an attempt's emergency checkpoint says to `show`, the report and the metrics (pure part).

The log and the note are a real 2-rank DDP run's (bench/bench_multirank_save.py, gloo on CPU:
rank 1 OOMed in step 8's forward, wrote checkpoint-7 alone with rank 0's RNG from the store),
its output folder replaced by @OUT@.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from supervisor.hooks.markers import EmergencyCheckpoint, describe, parse_emergency, parse_note

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "emergency"
OUT = "/w/out"


def recorded_log() -> list[str]:
    return (FIXTURES / "ddp2_rank1_saved.log").read_text().replace("@OUT@", OUT).splitlines()


def recorded_note() -> bytes:
    return (FIXTURES / "ddp2_rank1_saved.note.json").read_bytes()


def test_the_recorded_replica_save_names_the_rank_that_ran_out_of_memory():
    em = parse_emergency(recorded_log())
    assert (em.outcome, em.step, em.path, em.seconds) == ("saved", 7, f"{OUT}/checkpoint-7", 0.6)
    assert (em.oom_rank, em.rank, em.world_size, em.rng_ranks) == (1, 1, 2, (0, 1))


def test_a_save_refused_on_a_rank_still_names_it():
    em = parse_emergency([
        ("[rank1]: oom-supervisor: no emergency checkpoint: the OOM hit the optimizer step of step 8 on rank 1 of 4: "
        "parameters and optimizer state may be half-updated, so saving them as step 7 would be wrong; the last "
        "regular checkpoint is the resume point")])
    assert (em.outcome, em.oom_rank, em.world_size) == ("not_attempted", 1, 4)
    words, data = describe(em, None, "node-b")
    assert words.endswith("[OOM on rank 1 of 4 (node-b)]") and (data["oom_rank"], data["node"]) == (1, "node-b")
    # One process says no rank at all.
    one = parse_emergency([("oom-supervisor: no emergency checkpoint: a CPU-allocator OOM before any optimizer step "
                           "finished in this process, which started at step 0; nothing newer ...")])
    assert one.oom_rank is None and describe(one)[1]["oom_rank"] is None


def test_the_recorded_note_says_who_wrote_what_and_how_long_it_took():
    note = parse_note(recorded_note())
    assert (note.step, note.failing_rank, note.writer_rank, note.world_size) == (7, 1, 1, 2)
    assert (note.save_s, note.rng_wait_s, note.rng_ranks, note.per_rank) == (0.512, 0.459, (0, 1), ())


def test_show_words_and_event_data_of_a_saved_replica():
    em, note = parse_emergency(recorded_log()), parse_note(recorded_note())
    words, data = describe(em, note, None)
    assert words == (f"emergency checkpoint at step 7: {OUT}/checkpoint-7 (saved in 0.6 s; written by rank 1 of 2; "
                     "OOM on rank 1 of 2; RNG of ranks [0, 1] in 0.459 s)")
    assert {k: data[k] for k in ("outcome", "step", "seconds", "oom_rank", "writer_rank", "world_size",
                                 "rng_ranks", "rng_wait_s")} == {
        "outcome": "saved", "step": 7, "seconds": 0.6, "oom_rank": 1, "writer_rank": 1, "world_size": 2,
        "rng_ranks": [0, 1], "rng_wait_s": 0.459}
    json.dumps(data)  # the event's data column
    # Without the note (unreadable, or another step's): the log's figures alone, never the note's.
    stale = parse_note(recorded_note().replace(b'"step": 7', b'"step": 5'))
    assert describe(em, stale)[1]["rng_wait_s"] is None and describe(em)[0].startswith(
        f"emergency checkpoint at step 7: {OUT}/checkpoint-7 (saved in 0.6 s; written by rank 1 of 2")


def test_each_ranks_own_save_and_node_where_the_note_lists_them():
    note = parse_note(json.dumps({"step": 7, "failing_rank": 3, "world_size": 4, "save_s": 2.5, "node": "node-b",
                                  "ranks": {"0": {"save_s": 2.1, "node": "node-a"}, "3": {"save_s": 2.4,
                                                                                          "node": "node-b"}}}).encode())
    em = EmergencyCheckpoint("saved", 7, "/o/checkpoint-7", None, 2.5, None, 9, "x", oom_rank=3, world_size=4)
    words, data = describe(em, note, None)
    assert "OOM on rank 3 of 4 (node-b)" in words and "per rank 0: 2.1 s (node-a), 3: 2.4 s (node-b)" in words
    assert data["per_rank"] == [{"rank": 0, "save_s": 2.1, "node": "node-a"}, {"rank": 3, "save_s": 2.4,
                                                                               "node": "node-b"}]


def test_a_hostile_note_gives_nothing_it_should_not():
    assert parse_note(b"[1, 2]") is None and parse_note(b"not json") is None and parse_note(None) is None
    assert parse_note(b" " * (64 << 10) + b"{}") is None  # over the bound
    odd = parse_note(json.dumps({"step": -1, "failing_rank": True, "save_s": "0.4", "rng_wait_s": -2,
                                 "rng_from_ranks": [0, "x", -3, 1], "node": "a\nb",
                                 "ranks": {"x": {}, "2": {"save_s": float("inf")}}}).encode())
    assert (odd.step, odd.failing_rank, odd.save_s, odd.rng_wait_s, odd.node) == (None, None, None, None, None)
    assert odd.rng_ranks == (0, 1) and odd.per_rank == ((2, None, None),)
    assert not math.isnan(parse_note(b'{"save_s": NaN}').save_s or 0.0)
