"""Properties of decide() over generated jobs and OOM sequences."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.core.models import DecisionKind, Overrides, Phase
from supervisor.judge.policy import BUILTIN_POLICY_DIR, decide, load_policy

from .builders import GiB, attempt, job, oom

POLICY = load_policy("default", search_dirs=[BUILTIN_POLICY_DIR])
PHASES = st.sampled_from([Phase.TRAIN_STEP, Phase.MODEL_LOAD, Phase.EVALUATION, Phase.UNKNOWN])


@settings(max_examples=150, deadline=None)
@given(micro=st.integers(1, 64), accum=st.integers(1, 16), world=st.integers(1, 8),
       phases=st.lists(PHASES, min_size=1, max_size=8), frag=st.booleans(),
       shaped=st.booleans(), short=st.floats(0.1, 200))
def test_escalations_keep_the_effective_batch_and_never_repeat(micro, accum, world, phases, frag, shaped, short):
    extra = ({"param_count": 8_030_000_000, "largest_layer_params": 525_000_000, "gpu_capacity_bytes": 80 * GiB,
              "model_shape": {"hidden_size": 4096, "num_layers": 32, "vocab_size": 128256}} if shaped else {})
    j = job({"per_device_train_batch_size": micro, "gradient_accumulation_steps": accum}, world_size=world, **extra)
    history, ov = [], Overrides()
    for n, phase in enumerate(phases, 1):
        d_oom = oom(phase, frag=frag, short_gib=short if shaped else None, cap_gib=80)
        history.append(attempt(n, ov, d_oom))
        d = decide(j, history, d_oom, POLICY)
        if d.kind != DecisionKind.ESCALATE:
            assert d.kind == DecisionKind.FAIL and d.reason
            break
        y = {**j.config, **d.overrides.yaml}
        assert y["per_device_train_batch_size"] * y["gradient_accumulation_steps"] == micro * accum
        assert y["per_device_train_batch_size"] >= 1
        assert d.overrides.fingerprint() not in {a.overrides.fingerprint() for a in history}
        if phase == Phase.EVALUATION:
            assert "per_device_train_batch_size" not in d.overrides.yaml or \
                d.overrides.yaml.get("per_device_train_batch_size") == ov.yaml.get("per_device_train_batch_size")
        ov = d.overrides


@settings(max_examples=150, deadline=None)
@given(world=st.sampled_from(["gpus", "nproc", "visible", "cpu", "unknown"]), n=st.integers(1, 8),
       phases=st.lists(PHASES, min_size=1, max_size=8), host_gib=st.sampled_from([None, 64, 256, 1024]),
       ds_explicit=st.booleans())
def test_no_escalation_changes_the_world_size_or_breaks_the_deepspeed_pair(world, n, phases, host_gib, ds_explicit):
    from supervisor.intake.deepspeed_config import check_launch_pair

    kw = {"gpus": tuple(range(n))} if world == "gpus" else \
        {"nproc_per_node": n, "visible_gpu_count": 8} if world == "nproc" else \
        {"visible_gpu_count": n} if world == "visible" else {"visible_gpu_count": 0} if world == "cpu" else {}
    ds = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}}
    j = job({"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "deepspeed": "ds.json"},
            param_count=3_000_000_000, host_ram_bytes=host_gib * GiB if host_gib else None,
            deepspeed_config=ds if ds_explicit else None, **kw)
    launched = j.launched_world_size()
    history, ov = [], Overrides()
    for k, phase in enumerate(phases, 1):
        d_oom = oom(phase, cap_gib=80)
        history.append(attempt(k, ov, d_oom))
        d = decide(j, history, d_oom, POLICY)
        if d.kind != DecisionKind.ESCALATE:
            break
        ov = d.overrides
        if "NPROC_PER_NODE" in ov.env:
            assert int(ov.env["NPROC_PER_NODE"]) == max(1, launched)
        if world == "unknown":
            assert "NPROC_PER_NODE" not in ov.env
        live_ds = ov.deepspeed if ov.deepspeed is not None else j.deepspeed_config
        assert check_launch_pair({**j.config, **ov.yaml}, live_ds, world_size=launched) == []
