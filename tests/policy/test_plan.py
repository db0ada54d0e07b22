"""The plan subcommand: the ladder a job would climb, without running anything."""

from __future__ import annotations

import argparse
import json

import pytest

from supervisor.cli import plan

LLAMA3_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 128256,
             "num_attention_heads": 32, "num_key_value_heads": 8}
JOB = """\
model_name_or_path: model
stage: sft
do_train: true
finetuning_type: full
dataset: alpaca_zh
template: llama3
cutoff_len: 4096
output_dir: saves/x
per_device_train_batch_size: 4
gradient_accumulation_steps: 2
bf16: true
"""


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths resolve against where plan runs, as for submit


def run_plan(tmp_path, capsys, *extra):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA3_8B))
    (tmp_path / "job.yaml").write_text(JOB)
    parser = argparse.ArgumentParser()
    plan.configure(parser)
    rc = plan.run(parser.parse_args([str(tmp_path / "job.yaml"), *extra]))
    return rc, capsys.readouterr()


def test_plan_json_shows_rungs_changes_and_estimates(tmp_path, capsys):
    rc, out = run_plan(tmp_path, capsys, "--json", "--gpu-memory", "80")
    assert rc == 0
    doc = json.loads(out.out)
    assert doc["policy"] == "default" and 7.9e9 < doc["params"] < 8.1e9
    rungs = [s["rung"] for s in doc["steps"][1:] if s["rung"]]
    # 8B full fine-tune on 80 GiB: ~120 GiB of model states; no batch split can close that.
    assert rungs == ["zero3_offload_optimizer"]
    first = doc["steps"][0]["estimate"]
    assert first["fits"] is False and first["model_states_gpu_gib"] > 100
    offload = next(s for s in doc["steps"] if s["rung"] == "zero3_offload_optimizer")
    assert offload["estimate"]["fits"] is True
    assert any(c["key"] == "deepspeed" for c in offload["changes"])
    assert all(s["estimate"].get("activations_gib", 0) >= 0 for s in doc["steps"])


def test_plan_text_and_refused_policy(tmp_path, capsys):
    rc, out = run_plan(tmp_path, capsys, "--policy", "conservative")
    assert rc == 0 and "policy 'conservative'" in out.out and "micro_batch" not in out.out
    parser = argparse.ArgumentParser()
    plan.configure(parser)
    assert plan.run(parser.parse_args([str(tmp_path / "job.yaml"), "--policy", "nope"])) == 2


def test_plan_without_gpu_size_climbs_the_ladder_plainly(tmp_path, capsys):
    _rc, out = run_plan(tmp_path, capsys, "--json")
    rungs = [s["rung"] for s in json.loads(out.out)["steps"][1:] if s["rung"]]
    assert rungs[:3] == ["micro_batch", "micro_batch", "grad_checkpointing"]
    assert "zero3_offload_optimizer" in rungs


def test_plan_warns_that_save_only_model_restarts_every_failure_from_zero(tmp_path, capsys, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "model").mkdir()
    (tmp_path / "a" / "model" / "config.json").write_text(json.dumps(LLAMA3_8B))
    (tmp_path / "a" / "job.yaml").write_text(JOB + "save_only_model: true\n")
    monkeypatch.chdir(tmp_path / "a")
    parser = argparse.ArgumentParser()
    plan.configure(parser)
    assert plan.run(parser.parse_args([str(tmp_path / "a" / "job.yaml")])) == 0
    out = capsys.readouterr().out
    assert "save_only_model" in out and "step 0" in out
    assert plan.run(parser.parse_args([str(tmp_path / "a" / "job.yaml"), "--json"])) == 0
    doc = json.loads(capsys.readouterr().out)
    assert any("save_only_model" in w for w in doc["warnings"])
