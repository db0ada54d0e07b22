"""A multi-rank emergency checkpoint through the real daemon, said by `show`, the report, the
goodput buckets and the metrics (issue 26: "say it").

The job replays a real 2-rank DDP run's log and note (tests/fixtures/emergency: rank 1 of 2 OOMed
in step 8's forward and wrote checkpoint-7 alone, 'saved in 0.6 s', rank 0's RNG after 0.459 s),
the save's 0.6 s spent between its 'saving' line and its result line, and exits 1 with the
run's traceback. The daemon, the record, the views are real; no training runs.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from rich.console import Console

from supervisor.cli.show import print_timeline
from supervisor.cli.timeline import job_timeline
from supervisor.core.states import JobState
from supervisor.service.metrics import Metrics
from supervisor.service.report import attempt_rows, collect, render_markdown
from tests.core.test_control import add_job, daemon_factory, run_until  # noqa: F401 - daemon_factory is a fixture
from tests.service.test_metrics import samples

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "emergency"
REPLAY = """
import json, os, sys, time
log, note, out = sys.argv[1:4]
text = open(log).read().replace("@OUT@", out)
os.makedirs(os.path.join(out, "checkpoint-7"))
with open(os.path.join(out, "checkpoint-7", "oom-supervisor-emergency.json"), "w") as fh:
    fh.write(open(note).read())
cut = text.index("\\n", text.index("emergency checkpoint: saving step 7")) + 1
sys.stdout.write(text[:cut]); sys.stdout.flush()
time.sleep(0.6)
sys.stdout.write(text[cut:]); sys.stdout.flush()
sys.exit(1)
"""


def test_a_replica_save_is_said_everywhere(daemon_factory, tmp_path):  # noqa: F811 - the imported fixture
    d = daemon_factory()
    script = tmp_path / "replay.py"
    script.write_text(REPLAY)
    out = tmp_path / "work" / "out"
    job = add_job(d, tmp_path, [sys.executable, str(script), str(FIXTURES / "ddp2_rank1_saved.log"),
                                str(FIXTURES / "ddp2_rank1_saved.note.json"), str(out)], max_attempts=1)
    run_until(d, lambda: d.store.job(job).state == JobState.FAILED, timeout=60, what="the job to fail")

    (event,) = [e for e in d.store.events(job) if e.kind == "emergency_checkpoint"]
    data = json.loads(event.data)
    assert {k: data[k] for k in ("outcome", "step", "seconds", "oom_rank", "writer_rank", "world_size",
                                 "rng_ranks", "rng_wait_s")} == {
        "outcome": "saved", "step": 7, "seconds": 0.6, "oom_rank": 1, "writer_rank": 1, "world_size": 2,
        "rng_ranks": [0, 1], "rng_wait_s": 0.459}
    assert d.store.attempt(job, 1).checkpoint_step_after == 7

    # show: the attempt's panel says the save, its time and the rank; the time line has the bucket.
    timeline = job_timeline(d.store, job)
    (first,) = timeline["attempt_list"]
    assert first["emergency_checkpoint"] == (
        f"emergency checkpoint at step 7: {out}/checkpoint-7 (saved in 0.6 s; written by rank 1 of 2; "
        "OOM on rank 1 of 2; RNG of ranks [0, 1] in 0.459 s)")
    buf = io.StringIO()
    print_timeline(timeline, Console(file=buf, width=400, highlight=False))
    shown = buf.getvalue()
    assert "saved in 0.6 s; written by rank 1 of 2; OOM on rank 1 of 2" in shown and "emergency saves" in shown
    spent = first["time"]["buckets"]["emergency_save"]
    assert 0.5 <= spent <= 0.6 + 0.2, first["time"]  # read within a poll of the lines' writes

    # The morning report: the attempt's row.
    night = collect(d.store, d.state, [job])
    head, row = attempt_rows(night.jobs[0])
    assert row[head.index("emergency save")] == "step 7 in 0.6 s, OOM on rank 1 of 2"
    assert "step 7 in 0.6 s, OOM on rank 1 of 2" in render_markdown(night, {})

    # The metrics, as scraped.
    m = Metrics(None)
    m.update(d.store)
    got = samples(m.render())
    assert got[("oom_supervisor_emergency_checkpoints_total", (("outcome", "saved"),))] == 1
    assert got[("oom_supervisor_emergency_save_seconds_total", ())] == 0.6
    assert got[("oom_supervisor_time_seconds", (("bucket", "emergency_save"),))] == spent
