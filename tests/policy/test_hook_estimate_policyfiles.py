"""The memory-fraction startup hook, the estimators, and policy-file strictness."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from supervisor.judge.policy import BUILTIN_POLICY_DIR, PolicyError, load_policy, parse_policy_text
from supervisor.judge.policy.estimate import (
    Setup,
    activation_bytes,
    model_states,
    read_model_shape,
    shape_from_config,
    zero2_model_states,
    zero3_model_states,
)
from supervisor.judge.policy.render import HOOK_DIR

LLAMA3_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 128256,
             "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False}


def run_py(code: str, env_extra: dict[str, str], timeout: int = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=timeout)


def test_hook_does_not_import_torch_in_processes_that_do_not(tmp_path):
    out = run_py("import sys; print('torch' in sys.modules)",
                 {"PYTHONPATH": str(HOOK_DIR), "OOM_SUPERVISOR_MEMORY_FRACTION": "0.88"})
    assert out.stdout.strip() == "False", out.stderr


def test_hook_queues_the_cap_after_torch_import_without_initialising_cuda(tmp_path):
    pytest.importorskip("torch")
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['CHAINED_SITECUSTOMIZE'] = 'ran'\n")
    code = ("import os, sys; before = 'torch' in sys.modules; import torch;"
            "print(before, torch._oom_supervisor_memory_fraction, torch.cuda.is_initialized(),"
            " any(getattr(c[0], '__qualname__', '').endswith('cap') for c in torch.cuda._queued_calls),"
            " os.environ.get('CHAINED_SITECUSTOMIZE'))")
    out = run_py(code, {"PYTHONPATH": f"{HOOK_DIR}:{other}", "OOM_SUPERVISOR_MEMORY_FRACTION": "0.88"})
    assert out.stdout.split() == ["False", "0.88", "False", "True", "ran"], out.stderr


def test_hook_refuses_a_bad_fraction_loudly():
    out = run_py("print('ok')", {"PYTHONPATH": str(HOOK_DIR), "OOM_SUPERVISOR_MEMORY_FRACTION": "1.5"})
    assert out.stdout.strip() == "ok" and "not a fraction" in out.stderr


def test_param_count_from_config_json(tmp_path):
    shape = shape_from_config(LLAMA3_8B)
    assert abs(shape.params - 8.03e9) / 8.03e9 < 0.01  # Llama-3-8B has 8.03B parameters
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    assert read_model_shape(tmp_path) == shape
    assert read_model_shape(tmp_path / "missing") is None


def test_formulas_agree_with_deepspeeds_own_estimators():
    pytest.importorskip("deepspeed", reason="deepspeed not installed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for params, largest, gpus in ((8_030_000_000, 525_000_000, 1), (70_000_000_000, 1_050_000_000, 8)):
        for off, off_p in ((False, False), (True, False), (True, True)):
            assert zero3_model_states(params, largest, num_gpus_per_node=gpus, cpu_offload=off,
                                      cpu_offload_params=off_p) == \
                tuple(int(x) for x in estimate_zero3_model_states_mem_needs(
                    params, largest, gpus, 1, cpu_offload=off, cpu_offload_params=off_p))
        for off in (False, True):
            assert zero2_model_states(params, num_gpus_per_node=gpus, cpu_offload=off) == \
                tuple(int(x) for x in estimate_zero2_model_states_mem_needs(params, gpus, 1, cpu_offload=off))


def test_offload_and_checkpointing_shrink_what_they_should():
    p, lil = 8_030_000_000, 525_000_000
    plain = model_states(p, lil, 1, Setup())[0]
    opt = model_states(p, lil, 1, Setup(3, True, False))[0]
    both = model_states(p, lil, 1, Setup(3, True, True))
    assert plain == 16 * p and opt < plain / 7 and both[0] == 4 * lil and both[1] > 18 * p
    kw = dict(micro_batch=4, seq_len=4096, hidden=4096, layers=32)
    assert activation_bytes(**kw, checkpointing=True) * 8 < activation_bytes(**kw, checkpointing=False)


def test_policy_files_refuse_unknown_keys_with_suggestions():
    with pytest.raises(PolicyError) as err:
        parse_policy_text("name: p\nladder: [allocater]\nbudgets: {oom_escalation: 3}\n", source="p.yaml")
    by_key = {p.key: p for p in err.value.problems}
    assert by_key["ladder.0"].suggestion == "allocator"
    assert by_key["budgets.oom_escalation"].message == "unknown key"
    assert by_key["budgets.oom_escalation"].suggestion == "oom_escalations"


def test_data_changing_rung_needs_explicit_permission():
    with pytest.raises(PolicyError, match="allow_data_changes: true"):
        parse_policy_text("name: p\nladder: [micro_batch, cutoff_len]\n")


def test_unknown_policy_name_suggests_a_known_one():
    with pytest.raises(PolicyError) as err:
        load_policy("conservativ", search_dirs=[BUILTIN_POLICY_DIR])
    assert err.value.problems[0].suggestion == "conservative"


def test_every_shipped_policy_loads_and_conservative_keeps_semantics():
    names = sorted(p.stem for p in BUILTIN_POLICY_DIR.glob("*.yaml"))
    assert {"default", "conservative"} <= set(names)
    for n in names:
        load_policy(n, search_dirs=[BUILTIN_POLICY_DIR])
    cons = load_policy("conservative", search_dirs=[BUILTIN_POLICY_DIR])
    assert not cons.allow_data_changes
    assert not {"micro_batch", "cutoff_len", "grad_checkpointing"} & set(cons.ladder)
    assert load_policy(str(BUILTIN_POLICY_DIR / "default.yaml"), search_dirs=[]).name == "default"


@pytest.mark.ml
def test_rendered_files_pass_llamafactorys_own_parser(tmp_path, default_policy):
    """The effective YAML + generated DeepSpeed JSON as LLaMA-Factory 0.9.5 and transformers read them."""
    pytest.importorskip("llamafactory", reason="llamafactory not installed")
    pytest.importorskip("deepspeed", reason="deepspeed not installed")
    from supervisor.core.models import Overrides, Phase
    from supervisor.intake.jobspec import parse_job_text
    from supervisor.judge.policy import decide, render_attempt

    from .builders import attempt, job, oom

    spec = parse_job_text("model_name_or_path: /m\nstage: sft\ndo_train: true\nfinetuning_type: full\n"
                          "dataset: d\ntemplate: default\noutput_dir: out\nper_device_train_batch_size: 4\n"
                          "learning_rate: 1e-5\nbf16: true\nuse_cpu: true\noverwrite_output_dir: true\n",
                          submit_dir=tmp_path)
    d = decide(job(dict(spec.config)), [attempt(1, Overrides(), oom(Phase.MODEL_LOAD))], oom(Phase.MODEL_LOAD),
               default_policy)
    r = render_attempt(spec, d.overrides, attempt_dir=tmp_path, resume_yaml={}, launcher=["llamafactory-cli"])
    for name, text in r.files.items():
        (tmp_path / name).write_text(text)
    code = ("import sys, yaml; from llamafactory.hparams.parser import _parse_train_args;"
            f"m, d, t, f, g = _parse_train_args(yaml.safe_load(open({str(tmp_path / 'effective.yaml')!r})));"
            "print(t.deepspeed, t.overwrite_output_dir, t.learning_rate, t.hf_deepspeed_config.is_zero3())")
    out = run_py(code, {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29613", "DS_ACCELERATOR": "cpu"}, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-4:] == [str(tmp_path / "ds_config.json"), "False", "1e-05", "True"]


@pytest.mark.ml
def test_allocator_strings_we_generate_parse_in_the_installed_torch(default_policy):
    """Unknown allocator options abort a run; the installed torch's own parser must accept ours."""
    pytest.importorskip("torch")
    from supervisor.core.models import Overrides
    from supervisor.judge.policy import decide

    from .builders import attempt, job, oom

    strings, ov = [], Overrides()
    j = job(torch_version="2.14.1", kind="command")
    for n in range(1, 6):
        d = decide(j, [attempt(n, ov, oom(frag=True, vendor="cuda"))], oom(frag=True, vendor="cuda"),
                   default_policy)
        if d.overrides is None or "PYTORCH_CUDA_ALLOC_CONF" not in d.overrides.env:
            break
        ov = d.overrides
        strings.append(ov.env["PYTORCH_CUDA_ALLOC_CONF"])
    ov2 = decide(j, [attempt(1, Overrides(), oom(subkind="library"))], oom(subkind="library"), default_policy)
    strings.append(ov2.overrides.env["PYTORCH_CUDA_ALLOC_CONF"])
    assert any("expandable_segments:True" in s for s in strings)
    assert any("per_process_memory_fraction:0.88" in s for s in strings)
    code = ("import json, sys, torch\n"
            "for s in json.loads(sys.argv[1]): torch.cuda.memory._set_allocator_settings(s)\n"
            "try:\n    torch.cuda.memory._set_allocator_settings('bogus_option:1')\nexcept Exception:\n"
            "    print('refuses unknown')\n")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(strings)], check=False, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "refuses unknown"
