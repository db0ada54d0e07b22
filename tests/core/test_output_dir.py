"""One output_dir = one running job (issue 20): the second job waits for the first, says so in
`status`, and `submit` says so up front. A real daemon, real processes (a stand-in trainer that
waits for a file the test writes), a real model folder and dataset registry for the checks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from ..conftest import REPO, DaemonProc, write_config

FAKE_LF = REPO / "tests" / "jobs" / "fake_lf_cli.py"


def lf_job(work: Path, log: Path, go: Path, gpu: int) -> str:
    (work / "model").mkdir(exist_ok=True)
    (work / "model" / "config.json").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 1}))
    (work / "data").mkdir(exist_ok=True)
    (work / "data" / "dataset_info.json").write_text(json.dumps({"tiny": {"file_name": "tiny.json"}}))
    (work / "data" / "tiny.json").write_text("[]\n")
    return yaml.safe_dump({
        "model_name_or_path": "model", "stage": "sft", "do_train": True, "finetuning_type": "lora",
        "dataset": "tiny", "template": "llama3", "output_dir": "saves/run", "save_steps": 5,
        "supervisor": {"launcher": [sys.executable, str(FAKE_LF)], "gpus": [gpu], "max_attempts": 1,
                       "workdir": str(work),
                       "env": {"FAKE_LF_LOG": str(log), "FAKE_LF_GO": str(go)}}})


def test_two_jobs_with_one_output_dir_never_train_at_once(dirs, tmp_path):
    state, spool, work = dirs
    d = DaemonProc(state, spool, write_config(tmp_path / "config.yaml", max_parallel=2, vram_release_timeout=0),
                   tmp_path / "daemon.log").start()
    log, go = tmp_path / "trainings.log", tmp_path / "go"
    try:
        job = work / "job.yaml"
        job.write_text(lf_job(work, log, go, 0))
        first = d.cli("submit", str(job), "--wait", "30")
        assert first.returncode == 0 and first.stdout.strip().endswith("job 1"), first.stderr
        d.wait_state(1, "running")
        d.wait_for(lambda: log.exists() and "start" in log.read_text(), what="job 1 training")
        job.write_text(lf_job(work, log, go, 1))  # another GPU: only the output_dir is shared
        res = d.cli("submit", str(job))  # a daemon runs: submit waits for the id by default
        assert res.returncode == 0 and res.stdout.strip().endswith("job 2"), res.stderr
        out = str(work / "saves" / "run")
        assert f"note: output_dir {out} is also job 1's (running): this job starts when job 1 has ended" \
            in res.stderr, res.stderr
        row = d.wait_for(lambda: next((j for j in d.status() if j["id"] == 2 and j["reason"]
                                       and "output_dir" in j["reason"]), None), what="job 2 said waiting")
        assert row["state"] == "queued" and f"waiting: output_dir {out} is also job 1's" in row["reason"]
        status = d.cli("status").stdout
        assert "waiting: output_dir" in " ".join(status.split()), status
        assert log.read_text().count("start") == 1, "job 2 must not start while job 1 trains there"
        go.write_text("")
        d.wait_state(1, "succeeded")
        d.wait_state(2, "succeeded", timeout=60)
        lines = log.read_text().splitlines()
        assert [ln.split()[0] for ln in lines] == ["start", "end", "start", "end"], lines
        assert all(ln.endswith("free") for ln in lines if ln.startswith("start")), lines
    finally:
        go.write_text("")
        d.stop()
