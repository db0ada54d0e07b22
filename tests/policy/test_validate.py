"""Validation of LLaMA-Factory configs: each of the source articles' mistakes, precisely."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.intake.deepspeed_config import validate_deepspeed_config
from supervisor.intake.jobspec import JobFileError, parse_job_text
from supervisor.intake.llamafactory.validate import validate_config

BASE = {"model_name_or_path": "/models/llama", "stage": "sft", "do_train": True, "dataset": "alpaca_zh",
        "template": "llama3", "output_dir": "saves/x"}


def problems(extra, workdir=Path("/nonexistent-workdir")):
    return {p.key: p for p in validate_config({**BASE, **extra}, workdir=workdir)}


def test_a_clean_config_has_no_problems():
    assert validate_config({**BASE, "finetuning_type": "lora", "lora_target": "all", "bf16": True,
                            "learning_rate": "1e-5", "per_device_train_batch_size": 2},
                           workdir=Path("/")) == []


def test_gpu_memory_utilization_says_remove_it_not_another_inference_key():
    p = problems({"gpu_memory_utilization": 0.88})["gpu_memory_utilization"]
    assert "vLLM inference setting" in p.message and "memory_fraction" in p.message
    assert "remove this line" in p.message
    assert p.suggestion is None, "issue 20: 'did you mean vllm_gpu_util' led to an inference key in a training config"


def test_an_inference_only_key_in_a_training_config_is_warned_about():
    warnings = []
    assert validate_config({**BASE, "vllm_gpu_util": 0.88}, workdir=Path("/"), warnings=warnings) == []
    (w,) = warnings
    assert w.key == "vllm_gpu_util" and "no effect on training" in w.message


def test_compute_type_suggests_bf16():
    p = problems({"compute_type": "bf16"})["compute_type"]
    assert p.message.startswith("not a LLaMA-Factory key")
    assert p.suggestion == "bf16: true"


def test_lora_target_with_full_finetuning_is_contradictory():
    p = problems({"finetuning_type": "full", "lora_target": "all"})["lora_target"]
    assert "applies only to LoRA, but finetuning_type is 'full'" in p.message
    assert p.suggestion == "finetuning_type: lora"


def test_misspelled_key_gets_the_nearest_valid_one():
    p = problems({"per_device_train_batchsize": 2})["per_device_train_batchsize"]
    assert p.suggestion == "per_device_train_batch_size"


def test_deepspeed_key_at_top_level_of_the_llamafactory_config():
    p = problems({"zero_optimisation": {"stage": 3}})["zero_optimisation"]
    assert "DeepSpeed key 'zero_optimization'" in p.message and p.suggestion == "deepspeed"


def test_missing_deepspeed_file_names_the_shipped_preset_and_the_workdir(tmp_path):
    p = problems({"deepspeed": "examples/deepspeed/ds_z3_offload.json"}, tmp_path)["deepspeed"]
    assert "LLaMA-Factory ships ds_z3_offload_config.json in examples/deepspeed/, not ds_z3_offload.json" in p.message
    assert f"a relative path resolves against the job's workdir {tmp_path}" in p.message
    assert "drop `deepspeed:`" in p.message and p.suggestion is None, "no checkout here: no path to suggest"
    (tmp_path / "examples" / "deepspeed").mkdir(parents=True)
    (tmp_path / "examples" / "deepspeed" / "ds_z3_offload_config.json").write_text("{}")
    p = problems({"deepspeed": "examples/deepspeed/ds_z3_offload.json"}, tmp_path)["deepspeed"]
    assert p.suggestion == str(tmp_path / "examples" / "deepspeed" / "ds_z3_offload_config.json")


def test_deepspeed_typo_inside_a_json_file(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps(
        {"zero_optimization": {"stage": 3, "stage3_parition_grads": True}}))
    p = problems({"deepspeed": "ds.json"}, tmp_path)["deepspeed.zero_optimization.stage3_parition_grads"]
    assert "misspelled, and not a DeepSpeed key in any spelling" in p.message
    assert str(tmp_path / "ds.json") in p.message
    assert p.suggestion is None


def test_deepspeed_typo_in_an_inline_mapping_and_an_ignored_top_level_key():
    got = problems({"deepspeed": {"zero_optimisation": {"stage": 3},
                                  "zero_optimization": {"stage": 3, "stage3_max_live_parameter": 1e9,
                                                        "offload_optimizer": {"device": "cpu",
                                                                              "buffer_size": 1}}}})
    top = got["deepspeed.zero_optimisation"]  # a typo of a section the config lacks: refused
    assert "silently ignores unknown top-level keys" in top.message and top.suggestion == "zero_optimization"
    assert got["deepspeed.zero_optimization.stage3_max_live_parameter"].suggestion == "stage3_max_live_parameters"
    assert "deepspeed.zero_optimization.offload_optimizer.buffer_size" in got


def test_inline_json_string_is_checked():
    got = problems({"deepspeed": '{"zero_optimization": {"stage": 4}}'})
    assert "4 is not one of [0, 1, 2, 3]" in got["deepspeed.zero_optimization.stage"].message


@pytest.mark.parametrize("key,value,message", [
    ("bf16", "true", "expected true/false, got the string 'true'"),
    ("per_device_train_batch_size", "2", "expected a number, got the string '2' (remove the quotes)"),
    ("per_device_train_batch_size", 2.5, "expected int, got 2.5"),
    ("flash_attn", "fa4", "'fa4' is not one of ['auto', 'disabled', 'sdpa', 'fa2', 'fa3']"),
    ("finetuning_type", "qlora", "'qlora' is not one of ['lora', 'oft', 'freeze', 'full']"),
    ("cutoff_len", True, "expected int, got true"),
])
def test_wrong_value_types(key, value, message):
    assert problems({key: value})[key].message.startswith(message)


def test_job_file_refusal_carries_lines_and_suggestions(tmp_path):
    text = ("model_name_or_path: /m\nstage: sft\ndo_train: true\nfinetuning_type: full\n"
            "lora_target: all\ncompute_type: bf16\ngpu_memory_utilization: 0.88\n"
            "deepspeed: examples/deepspeed/ds_z3_offload.json\n")
    with pytest.raises(JobFileError) as err:
        parse_job_text(text, source="seed.yaml", submit_dir=tmp_path)
    by_key = {p.key: p for p in err.value.problems}
    assert by_key["compute_type"].line == 6 and by_key["gpu_memory_utilization"].line == 7
    assert by_key["deepspeed"].line == 8 and by_key["lora_target"].line == 5


def test_deepspeed_validation_with_deepspeeds_own_models():
    pytest.importorskip("deepspeed", reason="deepspeed not installed (pip install deepspeed==0.19.8)")
    bad = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 2.0}}}
    got = validate_deepspeed_config(bad, schema="installed")
    assert any(p.key == "deepspeed.zero_optimization.offload_optimizer.ratio" for p in got)


def test_frozen_schema_matches_the_installed_packages():
    """lf_keys.py / ds_keys.py must be regenerated when llamafactory or deepspeed change."""
    pytest.importorskip("llamafactory", reason="llamafactory not installed")
    pytest.importorskip("deepspeed", reason="deepspeed not installed")
    code = ("import json; from supervisor.intake.llamafactory import introspect as i, lf_keys, ds_keys;"
            "print(json.dumps([i.llamafactory_fields() == lf_keys.FIELDS, i.deepspeed_schema() == ds_keys.SCHEMA,"
            "i.llamafactory_version() == lf_keys.LLAMAFACTORY_VERSION]))")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=180,
                         env={"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, True, True], (
        "regenerate: python -m supervisor.intake.llamafactory.generate_keys")


def test_validation_does_not_import_torch():
    code = ("import sys; from pathlib import Path; from supervisor.intake.llamafactory.validate import validate_config;"
            "validate_config({'deepspeed': {'zero_optimization': {'stage': 3}}, 'bf16': True}, workdir=Path('/'));"
            "import supervisor.judge.policy; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_save_only_model_is_a_warning_not_a_problem(tmp_path):
    from supervisor.intake.llamafactory.validate import config_warnings, validate_config

    cfg = {"model_name_or_path": "m", "stage": "sft", "do_train": True, "output_dir": "o",
           "save_only_model": True}
    assert not [p for p in validate_config(cfg, workdir=tmp_path) if p.key == "save_only_model"]
    warnings = config_warnings(cfg)
    assert [w.key for w in warnings] == ["save_only_model"]
    assert "step 0" in warnings[0].message and "optimizer" in warnings[0].message
    assert config_warnings({**cfg, "save_only_model": False}) == []
