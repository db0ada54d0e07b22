"""Choosing with a predicted memory picture: compound steps, calibration, the bench targets."""

from __future__ import annotations

from pathlib import Path

from supervisor.core.models import DecisionKind, Overrides, Phase
from supervisor.judge.policy import decide
from supervisor.judge.policy.search import base_need, calibration

from .builders import GiB, attempt, job, oom

LLAMA3_8B_SHAPE = {"hidden_size": 4096, "num_layers": 32, "vocab_size": 128256}
P8B, LIL8B = 8_030_000_000, 525_000_000
REPO = Path(__file__).resolve().parents[2]


def shaped(config=None, **kw):
    return job(config, param_count=P8B, largest_layer_params=LIL8B, model_shape=LLAMA3_8B_SHAPE, **kw)


def test_combines_rungs_when_no_single_one_is_predicted_to_fit(default_policy):
    # 8B full FT, seq 4096, micro 8, checkpointing off, on a 48 GiB card: neither a smaller
    # batch nor offload alone is enough; one step takes both (plus what else is needed).
    j = shaped({"cutoff_len": 4096, "disable_gradient_checkpointing": True, "per_device_train_batch_size": 8,
                "gradient_accumulation_steps": 2}, gpu_capacity_bytes=48 * GiB)
    d = decide(j, [attempt(1, Overrides(), oom(short_gib=4, cap_gib=48))], oom(short_gib=4, cap_gib=48),
               default_policy)
    assert d.kind == DecisionKind.ESCALATE
    assert "+" in d.rung and "zero3_offload_optimizer" in d.rung
    assert "predicted to fit" in d.reason
    y = d.overrides.yaml
    if "per_device_train_batch_size" in y:
        assert y["per_device_train_batch_size"] * y["gradient_accumulation_steps"] == 16
    assert base_need(j, d.overrides) <= 48 * GiB


def test_model_load_first_step_is_offload_even_when_combined(default_policy):
    j = shaped({"cutoff_len": 2048}, gpu_capacity_bytes=12 * GiB)
    d = decide(j, [attempt(1, Overrides(), oom(Phase.MODEL_LOAD, short_gib=5, cap_gib=12))],
               oom(Phase.MODEL_LOAD, short_gib=5, cap_gib=12), default_policy)
    assert d.rung.split("+")[0] == "zero3_offload_param"


def test_prefers_the_faster_config_that_fits(default_policy):
    # 8B full FT at seq 8192 on 192 GiB: ~120 GiB of model states, logits and activations
    # overshoot by ~16 GiB. Halving the batch is enough and cheap; offload would fit too but slower.
    j = shaped({"cutoff_len": 8192, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1},
               gpu_capacity_bytes=192 * GiB)
    short = base_need(j, Overrides()) / GiB - 192
    assert 5 < short < 30
    d = decide(j, [attempt(1, Overrides(), oom(short_gib=short, cap_gib=192))], oom(short_gib=short, cap_gib=192),
               default_policy)
    assert d.rung == "micro_batch" and d.overrides.deepspeed is None
    assert d.overrides.yaml == {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}


def test_calibration_learns_from_what_the_failed_attempts_demanded():
    j = shaped({"cutoff_len": 2048}, gpu_capacity_bytes=80 * GiB)
    assert calibration(j, []) == 1.0
    pred = base_need(j, Overrides())
    big = oom(short_gib=pred / GiB, cap_gib=80)  # the attempt demanded ~80 + pred GiB
    assert calibration(j, [attempt(1, Overrides(), big)]) > 1.5


def test_search_never_proposes_a_configuration_that_failed(default_policy):
    j = shaped({"cutoff_len": 8192, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1},
               gpu_capacity_bytes=192 * GiB)
    first = oom(short_gib=16, cap_gib=192)
    d1 = decide(j, [attempt(1, Overrides(), first)], first, default_policy)
    h = [attempt(1, Overrides(), first), attempt(2, d1.overrides, oom(short_gib=1, cap_gib=192))]
    d2 = decide(j, h, oom(short_gib=1, cap_gib=192), default_policy)
    assert d2.kind == DecisionKind.ESCALATE
    assert d2.overrides.fingerprint() not in {a.overrides.fingerprint() for a in h}


def _bench():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("bench_policy", REPO / "bench" / "bench_policy.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_bench_meets_its_targets(default_policy):
    """The climb on every scenario; and two nights of a 10% hash sample of `base` (both parts):
    night 2 never fails where night 1 fit nor costs more (issue 27), and on the held-out part its
    first attempt fits >= 95% at a median cost <= 1.05x. In-process: no interpreter to start."""
    bench = _bench()
    for name in bench.SCENARIOS:
        s, _ = bench.summarise(name, default_policy)
        assert s["feasible_but_gave_up"] == 0, name
        assert s["world_size_changed"] == 0, name
        assert s["failed_escalations_median"] <= 1 and s["failed_escalations_p90"] <= 2, name
        # world8: 70B LoRA on 24 GiB cards lands on parameter offload at micro 1-2 (~0.5 of best)
        p10 = 0.85 if name == "world8" else 0.9
        assert s["throughput_vs_best_median"] >= 0.9 and s["throughput_vs_best_p10"] >= p10, name
        if name == "foreign":
            assert s["job_changed_though_it_fits"] == 0
    fig = bench.parts(default_policy, "base", share=10)
    for part in ("dev", "heldout"):
        assert fig[part]["cases"] >= 10, part
        # Held-out cases are counted, never shown: rules are written from development cases.
        shown = fig[part] if part == "dev" else len(fig[part]["night2_costs_more"])
        assert not fig[part]["night2_failed_where_night1_fit"], (part, shown)
        assert not fig[part]["night2_costs_more"], (part, shown)
    assert fig["heldout"]["night2"]["first_attempt_fit"] >= 0.95, fig["heldout"]
    assert fig["heldout"]["night2"]["cost_median"] <= 1.05, fig["heldout"]
