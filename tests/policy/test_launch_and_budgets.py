"""Remedies that fit the launch really run (issue 10): world size, DeepSpeed batch fields,
one host-RAM budget, memory held by others, fit checks, environment failures, repeats."""

from __future__ import annotations

import json

import pytest

from supervisor.core.models import Category, DecisionKind, Diagnosis, Overrides, Phase
from supervisor.intake.deepspeed_config import check_launch_pair
from supervisor.judge.policy import decide

from .builders import GiB, attempt, job, oom


def first(j, d, policy, overrides=None, ckpt=None):
    return decide(j, [attempt(1, overrides or Overrides(), d, ckpt)], d, policy)


# --- 1. a remedy never changes the world size -------------------------------------------------

def test_effective_batch_counts_every_visible_gpu_when_gpus_is_absent(default_policy):
    d = first(job({"per_device_train_batch_size": 8}, visible_gpu_count=8), oom(), default_policy)
    assert d.rung == "micro_batch"
    assert "8x1x8 = 4x2x8 unchanged" in d.reason


@pytest.mark.parametrize("kw,expected", [
    ({"visible_gpu_count": 8}, "8"),          # no gpus: LLaMA-Factory runs torchrun on all 8
    ({"gpus": (2, 3)}, "2"),
    ({"nproc_per_node": 4, "visible_gpu_count": 8}, "4"),
    ({"visible_gpu_count": 0}, "1"),          # CPU box: torchrun would get --nproc_per_node 0
    ({}, None),                               # unknown: leave LLaMA-Factory's own count alone
])
def test_zero3_rung_keeps_the_launched_world_size(default_policy, kw, expected):
    j = job(param_count=8_000_000_000, **kw)
    d = first(j, oom(Phase.MODEL_LOAD), default_policy)
    assert d.kind == DecisionKind.ESCALATE and d.rung.startswith("zero3"), d.reason
    assert d.overrides.env.get("NPROC_PER_NODE") == expected
    assert d.overrides.env["FORCE_TORCHRUN"] == "1"


# --- 2. explicit DeepSpeed batch fields follow the micro-batch split ----------------------------

EXPLICIT_DS = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
               "train_batch_size": 32, "zero_optimization": {"stage": 2}}


def test_micro_batch_rewrites_explicit_deepspeed_batch_fields(default_policy):
    j = job({"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "deepspeed": "ds.json"},
            gpus=(0, 1), world_size=2, deepspeed_config=EXPLICIT_DS)
    d = first(j, oom(), default_policy)
    assert d.rung == "micro_batch"
    ds = d.overrides.deepspeed
    assert ds is not None and ds["zero_optimization"] == {"stage": 2}
    y = d.overrides.yaml
    assert ds["train_micro_batch_size_per_gpu"] == y["per_device_train_batch_size"] == 4
    assert ds["gradient_accumulation_steps"] == y["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 32
    assert any(c.target == "deepspeed" for c in d.changes)
    assert check_launch_pair({**j.config, **y}, ds, world_size=2) == []


def test_auto_deepspeed_batch_fields_are_left_alone(default_policy):
    auto = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": 2}}
    d = first(job({"deepspeed": "ds.json"}, deepspeed_config=auto), oom(), default_policy)
    assert d.rung == "micro_batch" and d.overrides.deepspeed is None


def test_launch_pair_check_names_what_transformers_refuses():
    cfg = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4, "max_grad_norm": 1.0}
    problems = check_launch_pair(cfg, EXPLICIT_DS, world_size=2)
    keys = {p.key for p in problems}
    assert keys == {"deepspeed.train_micro_batch_size_per_gpu", "deepspeed.gradient_accumulation_steps"}
    assert "per_device_train_batch_size=4" in str(problems[0]) or "4" in str(problems[0])
    # train_batch_size = world x micro x accum: 2 x 4 x 4 = 32 agrees
    assert check_launch_pair(cfg, {"train_batch_size": 16}, world_size=2)[0].key == "deepspeed.train_batch_size"
    assert check_launch_pair(cfg, {"gradient_clipping": 0.5}, world_size=2)[0].key == "deepspeed.gradient_clipping"
    assert check_launch_pair(cfg, {"train_batch_size": "auto", "gradient_clipping": "auto"}, world_size=2) == []
    assert check_launch_pair(cfg, None, world_size=2) == []


def test_rendered_attempt_carries_the_rewritten_deepspeed_json(default_policy, tmp_path):
    from supervisor.intake.jobspec import parse_job_text
    from supervisor.judge.policy import render_attempt

    (tmp_path / "ds.json").write_text(json.dumps(EXPLICIT_DS))
    text = ("model_name_or_path: /m\nstage: sft\ndo_train: true\nfinetuning_type: lora\ndataset: x\n"
            "template: default\noutput_dir: out\nper_device_train_batch_size: 8\n"
            "gradient_accumulation_steps: 2\ndeepspeed: ds.json\n")
    spec = parse_job_text(text, submit_dir=tmp_path)
    j = job(dict(spec.config), gpus=(0, 1), world_size=2, deepspeed_config=EXPLICIT_DS)
    d = first(j, oom(), default_policy)
    r = render_attempt(spec, d.overrides, attempt_dir=tmp_path / "a1", resume_yaml={}, launcher=["lf"])
    ds = json.loads(r.files["ds_config.json"])
    assert ds["train_micro_batch_size_per_gpu"] == 4
    import yaml
    eff = yaml.safe_load(r.files["effective.yaml"])
    assert eff["deepspeed"] == str(tmp_path / "a1" / "ds_config.json")
    assert check_launch_pair(eff, ds, world_size=2) == []
    from supervisor.judge.policy import check_rendered

    assert check_rendered(r, user_deepspeed=EXPLICIT_DS, world_size=2) == []
    # the same YAML split against the user's unrewritten JSON is what transformers refuses
    plain = render_attempt(spec, Overrides(yaml=d.overrides.yaml), attempt_dir=tmp_path / "a2", resume_yaml={},
                           launcher=["lf"])
    assert {p.key for p in check_rendered(plain, user_deepspeed=EXPLICIT_DS, world_size=2)} == {
        "deepspeed.train_micro_batch_size_per_gpu", "deepspeed.gradient_accumulation_steps"}


# --- 3. one host-RAM budget; step back from the rung that caused a host OOM ---------------------

def test_offload_admission_does_not_count_what_other_processes_hold(default_policy):
    """Issue 16, case 6: what others hold is waited for before the attempt starts (hostwait.py),
    never a reason to change the job's remedy. 3.5B full FT: ~3.5e9 x 16 x 1.5 = ~78 GiB host for
    optimizer offload; the box has 128 GiB (budget ~115 GiB) of which others hold 60 GiB now."""
    j = job(param_count=3_500_000_000, host_ram_bytes=128 * GiB, host_used_by_others_bytes=60 * GiB,
            gpus=(0, 1, 2, 3))
    d = first(j, oom(Phase.MODEL_LOAD), default_policy)
    assert d.rung == "zero3_offload_optimizer", d.reason
    assert "needs ~78 GiB host RAM" in d.reason


def test_offload_over_the_buffered_budget_is_the_last_resort_not_a_failure(default_policy):
    """Issue 16, case 5: 70B full fine-tune on one 80 GiB GPU of an 1800 GiB box, out of GPU memory
    loading the model: parameter offload needs ~1774 GiB by DeepSpeed's estimate with its 1.5x
    buffer (over the ~1620 GiB budget) but ~1183 GiB without it. It is tried, not failed."""
    kw = {"param_count": 70_553_706_496, "largest_layer_params": 1_050_673_152, "gpu_capacity_bytes": 80 * GiB}
    load_oom = oom(Phase.MODEL_LOAD, short_gib=70, cap_gib=80)
    d = first(job(host_ram_bytes=1800 * GiB, **kw), load_oom, default_policy)
    assert d.kind == DecisionKind.ESCALATE and d.rung == "zero3_offload_param", d.reason
    assert "~1774 GiB host RAM (1.5x buffer) is above the ~1620 GiB" in d.reason
    assert "~1183 GiB without the buffer fits the box: tried" in d.reason
    # Over the box even without the buffer: impossible, so it fails, saying so.
    d = first(job(host_ram_bytes=1024 * GiB, **kw), load_oom, default_policy)
    assert d.kind == DecisionKind.FAIL and "impossible here" in d.reason, d.reason


def test_offload_admission_uses_the_jobs_own_limit(default_policy):
    j = job(param_count=3_500_000_000, host_ram_bytes=1024 * GiB, host_memory_limit_bytes=64 * GiB,
            gpus=(0, 1, 2, 3))
    d = first(j, oom(Phase.MODEL_LOAD), default_policy)
    assert not (d.rung or "").startswith("zero3"), d.reason


def test_host_oom_after_offload_steps_back_instead_of_shrinking_the_batch(default_policy):
    j = job({"per_device_train_batch_size": 8}, param_count=8_000_000_000, host_ram_bytes=1024 * GiB,
            gpus=(0, 1))
    gpu = oom(short_gib=4, cap_gib=80)
    d1 = first(j, gpu, default_policy)
    assert d1.kind == DecisionKind.ESCALATE
    ov1 = d1.overrides
    # walk until an offload rung is taken
    hist = [attempt(1, Overrides(), gpu)]
    n = 1
    while not any(r.startswith("zero3") for r in ov1.rungs):
        n += 1
        hist.append(attempt(n, ov1, gpu))
        dn = decide(j, hist, gpu, default_policy)
        assert dn.kind == DecisionKind.ESCALATE, dn.reason
        ov1 = dn.overrides
    host = Diagnosis(Category.HOST_OOM, "host out of memory", phase=Phase.TRAIN_STEP)
    hist.append(attempt(n + 1, ov1, host))
    d = decide(j, hist, host, default_policy)
    assert d.overrides is None or not any(r.startswith("zero3") for r in d.overrides.rungs), d.reason
    assert "step" in d.reason and "back" in d.reason
    assert d.rung != "eval_batch"


def test_host_oom_in_a_train_step_never_shrinks_the_eval_batch(default_policy):
    j = job({"per_device_train_batch_size": 1, "gradient_accumulation_steps": 8,
             "per_device_eval_batch_size": 8})
    host = Diagnosis(Category.HOST_OOM, "host out of memory", phase=Phase.TRAIN_STEP)
    d = first(j, host, default_policy)
    assert d.rung != "eval_batch", d.reason


# --- 4. memory held by other processes: wait, do not change the job ----------------------------

def test_gpu_held_by_others_waits_and_retries(default_policy):
    numbers = {"tried_to_allocate": 2 * GiB, "free": 1 * GiB, "total_capacity": 80 * GiB,
               "held_by_others": 70 * GiB}
    d0 = Diagnosis(Category.GPU_OOM, "out of memory", phase=Phase.TRAIN_STEP, numbers=numbers)
    d = first(job(), d0, default_policy)
    assert d.kind == DecisionKind.RETRY and d.delay_s > 0
    assert "70.00 GiB" in d.reason and "other process" in d.reason
    assert d.overrides == Overrides()
    d = first(job(gpu_memory_holders=("pid 4242 (python3): 70.0 GiB",)), d0, default_policy)
    assert "pid 4242 (python3): 70.0 GiB" in d.reason


def test_the_users_config_stays_eligible_after_a_foreign_oom(default_policy):
    numbers = {"tried_to_allocate": 2 * GiB, "free": 1 * GiB, "total_capacity": 80 * GiB,
               "held_by_others": 70 * GiB}
    foreign = Diagnosis(Category.GPU_OOM, "out of memory", phase=Phase.TRAIN_STEP, numbers=numbers)
    own = oom()
    hist = [attempt(1, Overrides(), foreign), attempt(2, Overrides(), own)]
    d = decide(job(), hist, own, default_policy)
    assert d.kind == DecisionKind.ESCALATE  # a real own OOM is still remedied


# --- 5. memory cap after a library OOM passes the fit check -------------------------------------

def test_memory_cap_is_skipped_when_pytorch_already_held_more_than_the_cap(default_policy):
    numbers = {"tried_to_allocate": 1 * GiB, "free": int(0.5 * GiB), "total_capacity": 80 * GiB,
               "allocated_by_pytorch": 74 * GiB, "reserved_unallocated": 3 * GiB}
    d0 = Diagnosis(Category.GPU_OOM, "cublas", subkind="cublas", phase=Phase.TRAIN_STEP, numbers=numbers)
    d = first(job({"per_device_train_batch_size": 8}, param_count=1_000_000_000), d0, default_policy)
    assert d.kind == DecisionKind.ESCALATE
    assert d.rung != "memory_fraction", d.reason
    assert "memory_fraction" in d.reason  # said why it was not taken alone


def test_memory_cap_alone_when_pytorch_fits_under_it(default_policy):
    numbers = {"tried_to_allocate": 1 * GiB, "free": int(0.5 * GiB), "total_capacity": 80 * GiB,
               "allocated_by_pytorch": 60 * GiB, "reserved_unallocated": 2 * GiB}
    d0 = Diagnosis(Category.GPU_OOM, "cublas", subkind="cublas", phase=Phase.TRAIN_STEP, numbers=numbers)
    d = first(job(), d0, default_policy)
    assert d.rung == "memory_fraction", d.reason


def test_reserved_unallocated_counts_in_the_fit_even_without_the_fragmentation_flag(default_policy):
    from supervisor.judge.policy import search as S
    from supervisor.judge.policy.decide import memory_picture

    shape = {"hidden_size": 4096, "num_layers": 32, "vocab_size": 128256}
    j = job({"finetuning_type": "lora", "cutoff_len": 2048, "per_device_train_batch_size": 8},
            param_count=8_000_000_000, model_shape=shape, gpu_capacity_bytes=80 * GiB)
    base = S.base_need(j, Overrides())
    numbers = {"tried_to_allocate": 1 * GiB, "free": int(0.5 * GiB), "total_capacity": 80 * GiB,
               "reserved_unallocated": 6 * GiB}
    d0 = Diagnosis(Category.GPU_OOM, "oom", phase=Phase.TRAIN_STEP, numbers=numbers, fragmentation=False)
    mem = memory_picture(j, Overrides(), d0)
    assert S.predicted_need(j, Overrides(), d0, mem, [attempt(1, Overrides(), d0)]) >= base + 6 * GiB - GiB


# --- 6. environment failures retry; a config error on a config that trained is suspect --------

def _env_diag():
    cat = getattr(Category, "ENVIRONMENT", None)
    if cat is None:
        pytest.skip("Category.ENVIRONMENT not in models yet")
    return Diagnosis(cat, "HTTPSConnectionPool(host='huggingface.co'): Max retries exceeded")


def test_environment_failure_is_retried_with_backoff_and_bounded(default_policy):
    e = _env_diag()
    d = first(job(), e, default_policy)
    assert d.kind == DecisionKind.RETRY and d.delay_s > 0
    b = default_policy.budgets
    hist = [attempt(i, Overrides(), e) for i in range(1, 60)]
    d = decide(job(max_attempts=20), hist[: b.environment_retries + 1], e, default_policy)
    assert d.kind == DecisionKind.WAIT and "waiting for the network" in d.reason  # issue 29: not failed
    spent = b.environment_retries + 1 + int(-(-b.environment_wait_max_s // b.environment_wait_s))
    d = decide(job(max_attempts=20), hist[:spent], e, default_policy)
    assert d.kind == DecisionKind.FAIL and "the network stayed down" in d.reason


def test_config_error_on_a_configuration_that_already_trained_is_retried_once(default_policy):
    ok = attempt(1, Overrides(), oom(Phase.TRAIN_STEP))
    ok = type(ok)(**{**ok.__dict__, "max_step": 40, "diagnosis": Diagnosis(Category.CRASH_OTHER, "x")})
    cfg = Diagnosis(Category.CONFIG_ERROR, "ValueError: cannot find dataset")
    d = decide(job(), [ok, attempt(2, Overrides(), cfg)], cfg, default_policy)
    assert d.kind == DecisionKind.RETRY and "step 40" in d.reason
    d = decide(job(), [ok, attempt(2, Overrides(), cfg), attempt(3, Overrides(), cfg)], cfg, default_policy)
    assert d.kind == DecisionKind.FAIL


def test_config_error_on_a_new_configuration_still_fails(default_policy):
    cfg = Diagnosis(Category.CONFIG_ERROR, "ValueError: bad key")
    assert first(job(), cfg, default_policy).kind == DecisionKind.FAIL


def test_a_hint_never_fails_the_job_or_pauses_the_queue(default_policy):
    for cat in (Category.CONFIG_ERROR, Category.DISK_FULL):
        h = Diagnosis(cat, "a line mentioning it", strength="hint")
        d = first(job(), h, default_policy)
        assert d.kind == DecisionKind.RETRY, (cat, d.reason)
        assert "hint" in d.reason


# --- 7. the same crash twice with no progress ---------------------------------------------------

def test_same_crash_twice_without_progress_stops_early(default_policy):
    c = Diagnosis(Category.CRASH_OTHER, "Segmentation fault", fingerprint="crash_other:segfault in foo")
    d = decide(job(), [attempt(1, Overrides(), c, 10), attempt(2, Overrides(), c, 10)], c, default_policy)
    assert d.kind == DecisionKind.FAIL and "same" in d.reason and "twice" in d.reason


def test_same_crash_with_progress_between_is_retried(default_policy):
    c = Diagnosis(Category.CRASH_OTHER, "Segmentation fault", fingerprint="crash_other:segfault in foo")
    d = decide(job(), [attempt(1, Overrides(), c, 10), attempt(2, Overrides(), c, 20)], c, default_policy)
    assert d.kind == DecisionKind.RETRY


def test_different_crashes_are_retried(default_policy):
    a = Diagnosis(Category.CRASH_OTHER, "x", fingerprint="a")
    b = Diagnosis(Category.CRASH_OTHER, "y", fingerprint="b")
    d = decide(job(), [attempt(1, Overrides(), a, 10), attempt(2, Overrides(), b, 10)], b, default_policy)
    assert d.kind == DecisionKind.RETRY


# --- 8. numeric failure: stop and name the last good checkpoint --------------------------------

def test_numeric_failure_names_the_last_good_checkpoint(default_policy):
    n = Diagnosis(Category.NUMERIC, "loss is nan at step 130", numbers={"step": 130})
    d = decide(job(), [attempt(1, Overrides(), oom(), 100), attempt(2, Overrides(), n, 120)], n, default_policy)
    assert d.kind == DecisionKind.FAIL
    assert "checkpoint-120" in d.reason


@pytest.mark.ml
def test_transformers_accepts_the_rewritten_pair_and_refuses_the_unrewritten_one(default_policy, tmp_path):
    """transformers' own fill_match on the rendered YAML + JSON (HfTrainerDeepSpeedConfig.mismatches)."""
    pytest.importorskip("llamafactory", reason="llamafactory not installed")
    pytest.importorskip("deepspeed", reason="deepspeed not installed")
    import subprocess
    import sys

    import yaml

    from supervisor.intake.jobspec import parse_job_text
    from supervisor.judge.policy import render_attempt

    ds1 = {**EXPLICIT_DS, "train_batch_size": 16}  # world size 1 here
    (tmp_path / "ds.json").write_text(json.dumps(ds1))
    spec = parse_job_text("model_name_or_path: /m\nstage: sft\ndo_train: true\nfinetuning_type: full\n"
                          "dataset: d\ntemplate: default\noutput_dir: out\nper_device_train_batch_size: 8\n"
                          "gradient_accumulation_steps: 2\nuse_cpu: true\ndeepspeed: ds.json\n",
                          submit_dir=tmp_path)
    j = job(dict(spec.config), visible_gpu_count=0, deepspeed_config=ds1)
    d = first(j, oom(), default_policy)
    r = render_attempt(spec, d.overrides, attempt_dir=tmp_path, resume_yaml={}, launcher=["llamafactory-cli"])
    for name, text in r.files.items():
        (tmp_path / name).write_text(text)
    unrewritten = {**yaml.safe_load(r.files["effective.yaml"]), "deepspeed": str(tmp_path / "ds.json")}
    (tmp_path / "unrewritten.yaml").write_text(yaml.safe_dump(unrewritten))
    code = ("import sys, yaml; from llamafactory.hparams.parser import _parse_train_args\n"
            "for f in sys.argv[1:]:\n"
            "    t = _parse_train_args(yaml.safe_load(open(f)))[2]\n"
            "    print(len(t.hf_deepspeed_config.mismatches))\n")
    env = {**{k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"},
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29617", "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "effective.yaml"),
                          str(tmp_path / "unrewritten.yaml")], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    rewritten_n, unrewritten_n = map(int, out.stdout.split()[-2:])
    assert rewritten_n == 0 and unrewritten_n == 2  # micro and accumulation; 16 = 1 x 4 x 4 still agrees
    eff = yaml.safe_load(r.files["effective.yaml"])
    assert check_launch_pair(eff, json.loads(r.files["ds_config.json"]), world_size=1) == []
    assert len(check_launch_pair(eff, ds1, world_size=1)) == unrewritten_n


SHAPE_8B = {"hidden_size": 4096, "num_layers": 32, "vocab_size": 128256}


@pytest.mark.parametrize("cutoff,rung", [(4096, "micro_batch+memory_fraction"), (2048, "memory_fraction")])
def test_library_oom_without_numbers_checks_the_cap_against_the_prediction(default_policy, cutoff, rung):
    # CUBLAS_STATUS_ALLOC_FAILED prints no PyTorch numbers: the fit check uses the estimate
    # (8B LoRA, micro 8: ~60 GiB at 4096 tokens, ~39 GiB at 2048; the cap leaves 0.88 x 64 = 56 GiB).
    j = job({"finetuning_type": "lora", "cutoff_len": cutoff, "per_device_train_batch_size": 8},
            param_count=8_000_000_000, model_shape=SHAPE_8B, gpu_capacity_bytes=64 * GiB)
    d0 = Diagnosis(Category.GPU_OOM, "CUBLAS_STATUS_ALLOC_FAILED", subkind="cublas", phase=Phase.TRAIN_STEP)
    d = first(j, d0, default_policy)
    assert d.kind == DecisionKind.ESCALATE and d.rung == rung, d.reason
    if rung != "memory_fraction":
        assert d.overrides.yaml["per_device_train_batch_size"] * d.overrides.yaml["gradient_accumulation_steps"] == 8


def test_a_library_oom_takes_one_allocator_step_not_four(default_policy):
    lib = Diagnosis(Category.GPU_OOM, "CUBLAS_STATUS_ALLOC_FAILED", subkind="cublas", phase=Phase.TRAIN_STEP)
    j = job({"per_device_train_batch_size": 8})
    hist, ov, rungs = [], Overrides(), []
    for n in range(1, 5):
        hist.append(attempt(n, ov, lib))
        d = decide(j, hist, lib, default_policy)
        assert d.kind == DecisionKind.ESCALATE
        rungs.append(d.rung)
        ov = d.overrides
    assert rungs.count("allocator") == 1, rungs
    assert rungs[0] == "memory_fraction" and "micro_batch" in rungs


def test_an_oom_under_the_cap_counts_the_cap_not_the_free_gpu(default_policy):
    # capped at 0.88 of 48 GiB = 42.2 GiB; PyTorch holds 42 GiB and wants 2 more: the 5.8 GiB the
    # GPU still has free are outside the cap, so it is 1.8 GiB short, not 0.
    from supervisor.judge.policy.decide import memory_picture

    numbers = {"total_capacity": 48 * GiB, "free": int(5.8 * GiB), "allowed": int(0.88 * 48 * GiB),
               "tried_to_allocate": 2 * GiB}
    d0 = Diagnosis(Category.GPU_OOM, "CUDA out of memory", phase=Phase.TRAIN_STEP, numbers=numbers)
    mem = memory_picture(job(), Overrides(), d0)
    assert 1.5 * GiB < mem.shortfall < 2 * GiB


def test_the_search_judges_a_capped_configuration_against_the_cap(default_policy):
    from supervisor.judge.policy import search as S
    from supervisor.judge.policy.decide import memory_picture

    cap = 44 * GiB
    j = job({"finetuning_type": "lora", "cutoff_len": 2048, "per_device_train_batch_size": 8},
            param_count=8_000_000_000, model_shape=SHAPE_8B, gpu_capacity_bytes=cap)
    capped = Overrides(env={"OOM_SUPERVISOR_MEMORY_FRACTION": "0.88"}, rungs=("memory_fraction",))
    assert 0.88 * cap * 0.95 < S.base_need(j, capped) < cap * 0.95  # fits the GPU, not the cap
    numbers = {"total_capacity": cap, "free": int(5.5 * GiB), "allowed": int(0.88 * cap),
               "tried_to_allocate": 2 * GiB}
    d0 = Diagnosis(Category.GPU_OOM, "CUDA out of memory", phase=Phase.TRAIN_STEP, numbers=numbers)
    d = decide(j, [attempt(1, Overrides(), oom()), attempt(2, capped, d0)], d0, default_policy)
    assert d.kind == DecisionKind.ESCALATE and d.rung != "allocator", d.reason
    need = S.predicted_need(j, d.overrides, d0, memory_picture(j, capped, d0), [])
    assert need <= 0.88 * cap * 0.95, d.reason
