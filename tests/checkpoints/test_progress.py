"""trainer_log.jsonl reading: this attempt's lines only, deltas for rates, partial lines survive."""

from __future__ import annotations

import json

import pytest

from supervisor.run.progress import parse_elapsed, read_progress, steps_lost


def line(step: int, elapsed: str, tokens: int | None = None, loss: float | None = 1.0, total: int = 20) -> str:
    rec = {"current_steps": step, "total_steps": total, "lr": 1e-4 / step, "epoch": step / total,
           "elapsed_time": elapsed, "remaining_time": "0:00:10"}
    if loss is not None:
        rec["loss"] = loss
    if tokens is not None:
        rec["total_tokens"] = tokens
    return json.dumps(rec) + "\n"


def test_rates_come_from_deltas_of_this_attempt_only(tmp_path):
    log = tmp_path / "trainer_log.jsonl"
    first = "".join(line(s, f"0:00:{2 * s:02d}", tokens=1000 * s, loss=5.0 - s / 10) for s in range(1, 9))
    log.write_text(first)
    offset = log.stat().st_size
    # Resumed at step 6: LLaMA-Factory's timer restarts while total_tokens continues.
    log.write_text(first + "".join(line(s, f"0:00:{4 * (s - 6):02d}", tokens=1000 * s, loss=4.0)
                                   for s in range(7, 12)))
    p = read_progress(tmp_path, since_offset=offset)
    assert (p.first_step, p.max_step, p.total_steps) == (7, 11, 20)
    assert p.steps_per_s == pytest.approx(4 / 16)  # steps 7..11 over 4..20 s
    assert p.tokens_per_s == pytest.approx(4000 / 16)
    assert p.last_loss == 4.0
    same = read_progress(tmp_path, since_step=6)  # selecting by step gives the same window
    assert (same.first_step, same.steps_per_s) == (7, p.steps_per_s)


def test_partial_last_line_and_garbage_are_skipped_and_resumable(tmp_path):
    log = tmp_path / "trainer_log.jsonl"
    log.write_bytes((line(1, "0:00:01") + "not json\n[1,2]\n" + line(2, "0:00:03")).encode() + b'{"current_st')
    p = read_progress(tmp_path)
    assert (p.max_step, p.bad_lines, p.lines) == (2, 2, 2)
    assert p.steps_per_s == pytest.approx(0.5)
    # end_offset stops before the partial line: reading on from it sees the line once complete.
    with open(log, "ab") as f:
        f.write(b'eps": 3, "elapsed_time": "0:00:05", "loss": 0.5}\n')
    q = read_progress(tmp_path, since_offset=p.end_offset)
    assert (q.first_step, q.max_step, q.last_loss, q.bad_lines) == (3, 3, 0.5, 0)


def test_missing_log_is_unknown_not_zero(tmp_path):
    p = read_progress(tmp_path)
    assert p.max_step is None and p.steps_per_s is None and p.lines == 0


def test_summary_line_without_loss_keeps_the_last_loss(tmp_path):
    (tmp_path / "trainer_log.jsonl").write_text(line(1, "0:00:01", loss=2.5) + line(1, "0:00:01", loss=None))
    p = read_progress(tmp_path)
    assert p.last_loss == 2.5 and p.steps_per_s is None  # no time passed: no rate invented


def test_steps_lost():
    assert steps_lost(9, 8) == 1
    assert steps_lost(17, None) == 17
    assert steps_lost(None, 8) is None
    assert steps_lost(8, 8) == 0


@pytest.mark.parametrize(("text", "seconds"), [("0:00:03", 3), ("1:02:03", 3723), ("2 days, 0:00:01", 172801),
                                               ("1 day, 1:00:00", 90000), ("0:00:01.500000", 1.5),
                                               ("soon", None), (None, None), (7, 7.0)])
def test_parse_elapsed(text, seconds):
    assert parse_elapsed(text) == seconds


def test_single_line_after_resume_still_gives_a_step_rate(tmp_path):
    from supervisor.run.progress import read_progress

    log = tmp_path / "trainer_log.jsonl"
    log.write_text('{"current_steps": 8, "total_steps": 9, "elapsed_time": "0:00:40"}\n')
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write('{"current_steps": 9, "total_steps": 9, "elapsed_time": "0:00:04"}\n')
    p = read_progress(tmp_path, since_step=8, since_offset=offset)
    assert p.max_step == 9 and p.steps_per_s == 0.25


def test_summary_line_repeating_the_last_step_does_not_hide_the_rate(tmp_path):
    from supervisor.run.progress import read_progress

    log = tmp_path / "trainer_log.jsonl"
    log.write_text('{"current_steps": 9, "total_steps": 9, "loss": 6.7, "elapsed_time": "0:00:03"}\n'
                   '{"current_steps": 9, "total_steps": 9, "elapsed_time": "0:00:03"}\n')
    p = read_progress(tmp_path, since_step=8, since_offset=0)
    assert p.max_step == 9 and abs(p.steps_per_s - 1 / 3) < 1e-9
