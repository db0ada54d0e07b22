"""Steps lost are a failed attempt's: a run that finished lost nothing, even when its last steps came
after its last checkpoint-N (the Trainer saves the final model at the end, not as checkpoint-N)."""

from __future__ import annotations

import json

from supervisor.record.store import AttemptRow


def _row(category: str | None, *, ended: bool = True) -> AttemptRow:
    return AttemptRow(job_id=1, number=1, started_at=0.0, ended_at=60.0 if ended else None, pid=1,
                      pid_create_time=0.0, overrides=None, remedy=None, resumed_from=None,
                      resumed_from_step=None, max_step=30, total_steps=30, checkpoint_step_after=28,
                      exit=None, diagnosis=json.dumps({"category": category}) if category else None,
                      decision=None, detected_at=None, peak_rss_bytes=None, steps_per_s=None,
                      tokens_per_s=None, interrupted=0)


def test_a_finished_run_lost_no_steps() -> None:
    assert _row("success").steps_lost is None


def test_a_running_attempt_has_lost_nothing_yet() -> None:
    assert _row(None, ended=False).steps_lost is None


def test_a_failed_attempt_lost_what_came_after_its_last_checkpoint() -> None:
    assert _row("gpu_oom").steps_lost == 2
