"""Run the escalation policy against simulated memory-limited trainings.

For a grid of model sizes, sequence lengths, GPU capacities, fine-tuning
types, user gradient-checkpointing choices and fragmentation, a simple
"true" memory and throughput model decides whether a configuration fits.
Starting from the user's configuration, every attempt that does not fit
produces an OOM diagnosis with the numbers a real OOM message carries
(capacity, free, the ONE allocation that failed -- a lower bound on the real
shortfall), which is fed to `decide()` until a configuration fits, the policy
gives up, or the budget ends.

Reported: failed escalations before a fitting configuration (the user's own
failed attempt not counted; median, p90), and the throughput of the config
the policy settled on against the best feasible config with the same
effective batch (exhaustive search over what the rungs can reach).

The simulator is deliberately NOT the policy's estimator: weights/grads/
optimizer by ZeRO stage and offload with DeepSpeed-like buffers, activations
~ micro x seq x hidden x layers (x34 without checkpointing, inputs only with
it), fp32 logits, a runtime overhead, fragmentation as unusable reserved
memory; throughput from 6*P FLOPs/token at a fixed MFU scaled by micro-batch
efficiency, +1/3 recompute with checkpointing, CPU Adam time for optimizer
offload and PCIe weight traffic for parameter offload.

    python bench/bench_policy.py [--policy default] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from supervisor.models import (
    AttemptRecord,
    Category,
    DecisionKind,
    Diagnosis,
    ExitRecord,
    JobContext,
    Overrides,
    Phase,
)
from supervisor.policy import BUILTIN_POLICY_DIR, decide, load_policy
from supervisor.policy.estimate import shape_from_config
from supervisor.policy.rungs import view_of

GiB = 1 << 30
MODELS = {  # name: config.json numbers (Qwen2.5 / Llama-3 shapes)
    "0.5B": dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864, vocab_size=151936,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960, vocab_size=151936,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "3B": dict(hidden_size=3072, num_hidden_layers=28, intermediate_size=8192, vocab_size=128256,
               num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True),
    "8B": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, vocab_size=128256,
               num_attention_heads=32, num_key_value_heads=8),
    "14B": dict(hidden_size=5120, num_hidden_layers=48, intermediate_size=13824, vocab_size=152064,
                num_attention_heads=40, num_key_value_heads=8),
    "32B": dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=27648, vocab_size=152064,
                num_attention_heads=40, num_key_value_heads=8),
    "70B": dict(hidden_size=8192, num_hidden_layers=80, intermediate_size=28672, vocab_size=128256,
                num_attention_heads=64, num_key_value_heads=8),
}
SEQ_LENS = (1024, 2048, 4096, 8192)
GPU_GIB = (24, 48, 80, 192)
HOST_RAM = 512 * GiB
OVERHEAD = int(1.5 * GiB)  # context, cuBLAS/hipBLAS workspaces, NCCL buffers
FRAG_SHARE = 0.10  # reserved-but-unusable share of the peak, until the allocator is tuned
LORA_SHARE = 0.008
GPU_FLOPS = 400e12 * 0.45  # peak x MFU
CPU_ADAM_S_PER_PARAM = 1.2e-9  # a DeepSpeed CPU-Adam step over host memory
PCIE_BPS = 25e9
NO_SHAPE = False  # --no-shape: the policy gets the parameter count only


@dataclass(frozen=True)
class Case:
    model: str
    seq: int
    gpu_gib: int
    finetuning: str
    gc_on: bool
    fragmented: bool
    micro: int = 8
    accum: int = 2


@dataclass(frozen=True)
class Config:
    micro: int
    accum: int
    gc: int  # 0 off, 1 on, 2 on + activations offloaded (unsloth)
    zero: int  # 0 none, 1 ZeRO-3 + optimizer offload, 2 + parameter offload
    allocator: bool
    seq: int | None = None  # cutoff_len when a data-changing policy shortened it


def config_of(case: Case, ov: Overrides, ctx: JobContext) -> Config:
    v = view_of(ctx, ov)
    gc = 0 if not v.gc_on else (2 if v.unsloth_gc else 1)
    zero = 0 if v.setup.zero_stage != 3 else (2 if v.setup.offload_param else 1)
    return Config(v.micro, v.accum, gc, zero, "PYTORCH_CUDA_ALLOC_CONF" in ov.env,
                  v.cutoff if v.cutoff != case.seq else None)


def true_memory(case: Case, cfg: Config) -> tuple[int, int, int, int]:
    """(gpu_peak_bytes, host_bytes, weights_on_gpu_at_load, largest_single_allocation)."""
    shape = shape_from_config(MODELS[case.model])
    p, lil = shape.params, shape.largest_layer_params
    t = 1.0 if case.finetuning == "full" else LORA_SHARE
    trainable, frozen = p * t, p * (1 - t)
    if cfg.zero == 0:
        states, host, weights = 16 * trainable + 2 * frozen, 0, 2 * p
    elif cfg.zero == 1:
        states, host, weights = 2 * p + 4 * lil + 0.6 * GiB, 12 * trainable * 1.3, 2 * p
    else:
        states, host, weights = 4 * lil + 1.2 * GiB, (12 * trainable + 2 * p) * 1.3, 4 * lil
    seq = cfg.seq or case.seq
    sbh = cfg.micro * seq * shape.hidden_size
    layers = shape.num_layers
    act = {0: 34 * sbh * layers, 1: 2 * sbh * layers + 34 * sbh, 2: 0.15 * sbh * layers + 34 * sbh}[cfg.gc]
    logits = 4 * cfg.micro * seq * shape.vocab_size
    peak = states + act + 1.5 * logits + OVERHEAD
    if case.fragmented and not cfg.allocator:
        peak *= 1 + FRAG_SHARE
    largest = max(logits, 34 * sbh / 4)
    return int(peak), int(host), int(weights), int(largest)


def throughput(case: Case, cfg: Config) -> float:
    """Tokens per second."""
    shape = shape_from_config(MODELS[case.model])
    p = shape.params
    tokens = cfg.micro * (cfg.seq or case.seq)
    eff = tokens / (tokens + 1536)  # small micro-batches use the GPU less well
    flops = (6 if case.finetuning == "full" else 4) * p * tokens * (1 + (cfg.gc >= 1) / 3)
    compute = flops / (GPU_FLOPS * eff) * (1.05 if cfg.gc == 2 else 1.0)
    per_micro = compute
    if cfg.zero == 2:
        per_micro = max(compute, 4 * p / PCIE_BPS) + 0.1 * compute
    step = per_micro * cfg.accum
    if cfg.zero >= 1:
        t = 1.0 if case.finetuning == "full" else LORA_SHARE
        step += CPU_ADAM_S_PER_PARAM * p * t + 0.05 * step
    if cfg.allocator:
        step *= 1.01
    return tokens * cfg.accum / step


def fits(case: Case, cfg: Config) -> tuple[bool, Diagnosis | None]:
    cap = case.gpu_gib * GiB
    peak, host, weights, largest = true_memory(case, cfg)
    if host > HOST_RAM:
        return False, Diagnosis(Category.HOST_OOM, "DefaultCPUAllocator: can't allocate memory", vendor="cpu",
                                phase=Phase.MODEL_LOAD)
    if peak <= cap:
        return True, None
    free = int(0.3 * GiB)
    phase = Phase.MODEL_LOAD if weights + OVERHEAD > cap else Phase.TRAIN_STEP
    frag = case.fragmented and not cfg.allocator and peak / (1 + FRAG_SHARE) <= cap
    numbers = {"total_capacity": cap, "free": free,
               "tried_to_allocate": min(largest, peak - cap + free) if phase == Phase.TRAIN_STEP
               else min(weights + OVERHEAD - cap + free, 4 * shape_from_config(MODELS[case.model]).largest_layer_params)}
    if frag:
        numbers["reserved_unallocated"] = int(peak - peak / (1 + FRAG_SHARE))
    return False, Diagnosis(Category.GPU_OOM, "HIP out of memory", vendor="hip", phase=phase,
                            numbers=numbers, fragmentation=frag)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def best_feasible(case: Case) -> tuple[Config, float] | None:
    per_device = case.micro * case.accum
    best = None
    for micro, gc, zero, alloc in itertools.product(_divisors(per_device), (0, 1, 2), (0, 1, 2), (False, True)):
        if gc < (1 if case.gc_on else 0):
            continue  # the policy never turns checkpointing off
        cfg = Config(micro, per_device // micro, gc, zero, alloc)
        if fits(case, cfg)[0]:
            thr = throughput(case, cfg)
            if best is None or thr > best[1]:
                best = (cfg, thr)
    return best


def run_case(case: Case, policy) -> dict:
    shape = shape_from_config(MODELS[case.model])
    config = {"model_name_or_path": f"/models/{case.model}", "stage": "sft", "finetuning_type": case.finetuning,
              "per_device_train_batch_size": case.micro, "gradient_accumulation_steps": case.accum,
              "cutoff_len": case.seq, "bf16": True, "disable_gradient_checkpointing": not case.gc_on}
    ctx = JobContext(id=1, name="sim", kind="llamafactory", config=config, world_size=1, max_attempts=10,
                     param_count=shape.params, largest_layer_params=shape.largest_layer_params,
                     gpu_capacity_bytes=case.gpu_gib * GiB, host_ram_bytes=HOST_RAM,
                     model_shape=None if NO_SHAPE else {"hidden_size": shape.hidden_size,
                                                        "num_layers": shape.num_layers,
                                                        "vocab_size": shape.vocab_size},
                     torch_version="2.14.1", transformers_version="5.6.0")
    history: list[AttemptRecord] = []
    ov = Overrides()
    rungs: list[str] = []
    for n in range(1, 20):
        cfg = config_of(case, ov, ctx)
        ok, diag = fits(case, cfg)
        if ok:
            return {"fit": True, "failed_escalations": n - 2, "config": cfg, "rungs": rungs}
        history.append(AttemptRecord(n, ov, diag, ExitRecord(1)))
        d = decide(ctx, history, diag, policy)
        if d.kind != DecisionKind.ESCALATE:
            return {"fit": False, "failed_escalations": n - 1, "reason": d.reason, "rungs": rungs}
        rungs.append(d.rung)
        ov = d.overrides
    return {"fit": False, "failed_escalations": 19, "reason": "loop", "rungs": rungs}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="default")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-shape", action="store_true", help="withhold the model shape from the policy")
    args = ap.parse_args(argv)
    global NO_SHAPE
    NO_SHAPE = args.no_shape
    policy = load_policy(args.policy, search_dirs=[BUILTIN_POLICY_DIR])
    results = []
    for model, seq, gpu, ft, gc_on, frag in itertools.product(MODELS, SEQ_LENS, GPU_GIB, ("full", "lora"),
                                                              (True, False), (False, True)):
        case = Case(model, seq, gpu, ft, gc_on, frag)
        if fits(case, Config(case.micro, case.accum, 1 if gc_on else 0, 0, False))[0]:
            continue  # the user's config fits: nothing to remedy
        best = best_feasible(case)
        r = run_case(case, policy)
        r.update(case=case, feasible=best is not None)
        if best and r["fit"]:
            r["ratio"] = throughput(case, r["config"]) / best[1]
            r["best"] = best[0]
        results.append(r)
    feasible = [r for r in results if r["feasible"]]
    fitted = [r for r in feasible if r["fit"]]
    missed = [r for r in feasible if not r["fit"]]
    infeasible_failed = sum(1 for r in results if not r["feasible"] and not r["fit"])
    esc = [r["failed_escalations"] for r in fitted]
    ratios = [r["ratio"] for r in fitted]
    summary = {
        "policy": policy.name,
        "cases_needing_a_remedy": len(results),
        "feasible": len(feasible),
        "fitted": len(fitted),
        "feasible_but_gave_up": len(missed),
        "infeasible_and_failed_honestly": infeasible_failed,
        "failed_escalations_median": statistics.median(esc) if esc else None,
        "failed_escalations_p90": pct(esc, 0.9) if esc else None,
        "failed_escalations_max": max(esc) if esc else None,
        "chose_shorter_cutoff": sum(1 for r in fitted if r["config"].seq),
        "throughput_vs_best_median": round(statistics.median(ratios), 3) if ratios else None,
        "throughput_vs_best_p10": round(pct(ratios, 0.1), 3) if ratios else None,
        "share_within_10pct_of_best": round(sum(r >= 0.9 for r in ratios) / len(ratios), 3) if ratios else None,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    for k, v in summary.items():
        print(f"{k:>34}: {v}")
    worst = sorted(fitted, key=lambda r: r["ratio"])[:5]
    print("\nworst throughput ratios:")
    for r in worst:
        c = r["case"]
        print(f"  {c.model} seq {c.seq} {c.gpu_gib} GiB {c.finetuning} gc={c.gc_on} frag={c.fragmented}: "
              f"{r['ratio']:.2f} via {r['rungs']} -> {r['config']} best {r['best']}")
    print("\nmost failed escalations:")
    for r in sorted(fitted, key=lambda r: -r["failed_escalations"])[:5]:
        c = r["case"]
        print(f"  {c.model} seq {c.seq} {c.gpu_gib} GiB {c.finetuning} gc={c.gc_on} frag={c.fragmented}: "
              f"{r['failed_escalations']} via {r['rungs']}")
    for r in missed[:5]:
        c = r["case"]
        print(f"  GAVE UP: {c.model} seq {c.seq} {c.gpu_gib} GiB {c.finetuning} gc={c.gc_on}: {r['reason'][:300]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
