"""A rank that aborts at exit after its training completed: `unknown`, and the "why not" points only
at what the log shows (issue 29's candidates; seen in CI on the ZeRO-3 night, see the fixture's about)."""

from __future__ import annotations

from pathlib import Path

from supervisor.core.models import Category, ExitRecord
from supervisor.judge.diagnosis import diagnose_bytes

LOG = Path(__file__).resolve().parents[1] / "fixtures/logs/unknown_llamafactory_zero3_rank_abort_after_final_save.log"


def test_an_abort_after_the_final_save_is_unknown_and_no_network_failure_is_suggested():
    d = diagnose_bytes(LOG.read_bytes(), ExitRecord(1, None))
    assert (d.category, d.subkind) == (Category.UNKNOWN, "abort"), d.summary
    assert "SIGABRT" in d.summary or "exitcode: -6" in d.summary, d.summary
    # "Training completed. Do not forget to share your model on huggingface.co/models =)" is the
    # trainer's farewell, not a request that failed: the network is not where to look
    assert [c.category for c in d.candidates] == [Category.CRASH_OTHER], d.candidates
