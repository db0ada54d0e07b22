"""render_attempt() against golden files; the generated DeepSpeed JSON checked by DeepSpeed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from supervisor.core.models import Overrides, Phase
from supervisor.intake.deepspeed_config import validate_deepspeed_config, zero3_offload_config
from supervisor.intake.jobspec import parse_job_text
from supervisor.judge.policy import decide, render_attempt
from supervisor.judge.policy.render import EMERGENCY_CKPT_ENV, HOOK_DIR

from .builders import attempt, job, oom

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
ATTEMPT = Path("/var/lib/oom-supervisor/jobs/3/attempt_2")
LAUNCHER = ["/opt/venv/bin/llamafactory-cli"]
# Every attempt: the start-up hook (tests/hooks/), and the launcher's own bin first on PATH (its torchrun)
HOOK_ENV = {EMERGENCY_CKPT_ENV: "1", "PYTHONPATH": str(HOOK_DIR), "PATH": "/opt/venv/bin"}

JOB = """\
model_name_or_path: /models/Meta-Llama-3-8B-Instruct
stage: sft
do_train: true
finetuning_type: full
dataset: alpaca_zh
template: llama3
cutoff_len: 2048
output_dir: saves/llama3-8b/full/sft
overwrite_output_dir: true
per_device_train_batch_size: 4
gradient_accumulation_steps: 2
learning_rate: 1e-5
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
supervisor:
  env:
    PYTORCH_HIP_ALLOC_CONF: roundup_power2_divisions:4
    HSA_FORCE_FINE_GRAIN_PCIE: "1"
"""


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing golden {path}; run with UPDATE_GOLDEN=1 once and review it"
    assert text == path.read_text(), f"{name} differs from its golden file"


@pytest.fixture
def spec(tmp_path):
    return parse_job_text(JOB, source="llama3.yaml", submit_dir=Path("/home/u/work"))


def test_first_attempt_only_forces_resume_safety(spec):
    r = render_attempt(spec, Overrides(), attempt_dir=ATTEMPT, resume_yaml={}, launcher=LAUNCHER)
    assert r.argv == [*LAUNCHER, "train", str(ATTEMPT / "effective.yaml")]
    eff = yaml.safe_load(r.files["effective.yaml"])
    assert eff["overwrite_output_dir"] is False
    assert eff["learning_rate"] == 1e-5 and isinstance(eff["learning_rate"], float)
    assert eff["output_dir"] == "saves/llama3-8b/full/sft"  # relative: cwd is the workdir
    assert r.env == HOOK_ENV
    assert [(c.key, c.old, c.new) for c in r.changes if c.target == "yaml"] == [("overwrite_output_dir", True, False)]
    check_golden("attempt1_effective.yaml", r.files["effective.yaml"])


def test_offload_attempt_renders_deepspeed_and_resume(default_policy, spec):
    j = job(dict(spec.config), visible_gpu_count=0)  # a CPU box: torchrun needs 1, not 0
    d = decide(j, [attempt(1, Overrides(), oom(Phase.MODEL_LOAD))], oom(Phase.MODEL_LOAD), default_policy)
    r = render_attempt(spec, d.overrides, attempt_dir=ATTEMPT,
                       resume_yaml={"resume_from_checkpoint": "saves/llama3-8b/full/sft/checkpoint-120"},
                       launcher=LAUNCHER)
    eff = yaml.safe_load(r.files["effective.yaml"])
    assert eff["deepspeed"] == str(ATTEMPT / "ds_config.json")
    assert eff["resume_from_checkpoint"].endswith("checkpoint-120")
    assert r.env == {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "1", **HOOK_ENV}
    ds = json.loads(r.files["ds_config.json"])
    assert ds["bf16"]["enabled"] is True and ds["zero_optimization"]["offload_param"]["pin_memory"] is True
    assert "examples" not in r.files["effective.yaml"]
    check_golden("offload_param_effective.yaml", r.files["effective.yaml"])
    check_golden("offload_param_ds_config.json", r.files["ds_config.json"])
    assert any(c.target == "deepspeed" for c in r.changes)


def test_allocator_keeps_the_users_options_under_every_name(default_policy, spec):
    d = decide(job(dict(spec.config)), [attempt(1, Overrides(), oom(frag=True))], oom(frag=True), default_policy)
    r = render_attempt(spec, d.overrides, attempt_dir=ATTEMPT, resume_yaml={}, launcher=LAUNCHER)
    want = "roundup_power2_divisions:4,garbage_collection_threshold:0.8,max_split_size_mb:512"
    assert r.env["PYTORCH_HIP_ALLOC_CONF"] == want
    assert r.env["PYTORCH_CUDA_ALLOC_CONF"] == want and r.env["PYTORCH_ALLOC_CONF"] == want
    assert r.env["OPTIM_TORCH"] == "0"
    env = {k: v for k, v in r.env.items() if k not in HOOK_ENV}  # HOOK_DIR is machine-specific
    check_golden("allocator_env.json", json.dumps(env, indent=2, sort_keys=True) + "\n")


def test_memory_fraction_hook_goes_first_on_pythonpath(default_policy):
    spec = parse_job_text("supervisor:\n  command: [python, train.py]\n  env: {PYTHONPATH: /opt/lib}\n",
                          submit_dir=Path("/w"))
    ov = Overrides(rungs=("memory_fraction",), env={"OOM_SUPERVISOR_MEMORY_FRACTION": "0.88"})
    r = render_attempt(spec, ov, attempt_dir=ATTEMPT, resume_yaml={}, launcher=LAUNCHER)
    assert r.argv == ["python", "train.py"] and r.files == {}
    assert r.env["PYTHONPATH"] == f"{HOOK_DIR}:/opt/lib"
    assert (HOOK_DIR / "sitecustomize.py").is_file()


def test_micro_batch_change_is_recorded_against_the_original(default_policy, spec):
    d = decide(job(dict(spec.config)), [attempt(1, Overrides(), oom())], oom(), default_policy)
    r = render_attempt(spec, d.overrides, attempt_dir=ATTEMPT, resume_yaml={}, launcher=LAUNCHER)
    got = {c.key: (c.old, c.new) for c in r.changes}
    assert got["per_device_train_batch_size"] == (4, 2)
    assert got["gradient_accumulation_steps"] == (2, 4)
    assert "unchanged" in next(c.why for c in r.changes if c.key == "per_device_train_batch_size")


@pytest.mark.parametrize("offload_param,bf16,fp16", [(True, True, None), (False, None, None), (True, None, True)])
def test_generated_deepspeed_config_passes_builtin_checks(offload_param, bf16, fp16):
    cfg = zero3_offload_config(offload_param=offload_param, bf16=bf16, fp16=fp16)
    assert validate_deepspeed_config(cfg) == []


@pytest.mark.parametrize("offload_param", [True, False])
def test_generated_deepspeed_config_is_accepted_by_deepspeed(offload_param, monkeypatch):
    pytest.importorskip("deepspeed", reason="deepspeed not installed (pip install deepspeed==0.19.8)")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.config import ZeroStageEnum

    cfg = zero3_offload_config(offload_param=offload_param, bf16=True, fp16=None)
    # The HF integration fills "auto" from the training arguments; do the same by hand.
    filled = json.loads(json.dumps(cfg).replace('"auto"', "null"))
    filled.update(train_batch_size=8, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2,
                  gradient_clipping=1.0)
    filled["fp16"]["enabled"] = False
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        filled["zero_optimization"][key] = 1_000_000
    ds = DeepSpeedConfig(filled)
    assert ds.zero_optimization_stage == ZeroStageEnum.weights
    assert ds.zero_config.offload_optimizer.device == "cpu" and ds.zero_config.offload_optimizer.pin_memory
    assert (ds.zero_config.offload_param is not None) == offload_param
    assert ds.zero_config.overlap_comm is True and ds.bfloat16_config.enabled
    assert validate_deepspeed_config(cfg, schema="installed") == []


def test_the_launchers_own_bin_goes_first_on_path_unless_the_job_sets_path(spec):
    """LLaMA-Factory's launcher runs torchrun from PATH (several GPUs, FORCE_TORCHRUN): under
    systemd PATH is /usr/bin:/bin, and a launcher named by its path has its torchrun beside it."""
    from supervisor.judge.plan import compose_environment

    r = render_attempt(spec, Overrides(), attempt_dir=ATTEMPT, resume_yaml={}, launcher=LAUNCHER)
    (change,) = [c for c in r.changes if c.key == "PATH"]
    assert change.new == "/opt/venv/bin:$PATH" and "torchrun" in change.why
    env = compose_environment({"PATH": "/usr/bin:/bin"}, spec.sup.env, r.env, {})
    assert env["PATH"] == "/opt/venv/bin:/usr/bin:/bin"
    assert compose_environment({}, spec.sup.env, r.env, {})["PATH"] == f"/opt/venv/bin:{os.defpath}"
    bare = render_attempt(spec, Overrides(), attempt_dir=ATTEMPT, resume_yaml={}, launcher=["llamafactory-cli"])
    assert "PATH" not in bare.env  # found on PATH, and so is its torchrun
    own = parse_job_text(JOB.replace("  env:\n", "  env:\n    PATH: /my/bin:/usr/bin\n"), source="j.yaml",
                         submit_dir=Path("/w"))
    mine = render_attempt(own, Overrides(), attempt_dir=ATTEMPT, resume_yaml={}, launcher=LAUNCHER)
    assert "PATH" not in mine.env
    assert compose_environment({"PATH": "/usr/bin"}, own.sup.env, mine.env, {})["PATH"] == "/my/bin:/usr/bin"
