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

Scenarios (each prints the same figures):

* `base`: one GPU, 512 GiB host RAM (the original grid);
* `world8`: no `gpus:` on an 8-GPU box (LLaMA-Factory runs torchrun on all 8); a remedy whose
  NPROC_PER_NODE launches another world size changes the effective batch: counted as a failure;
* `ds_explicit`: the job's DeepSpeed JSON (ZeRO-0) spells out train_micro_batch_size_per_gpu,
  gradient_accumulation_steps and train_batch_size; a rendered pair that disagrees is refused by
  transformers at start-up (config_error), as `fill_match` does;
* `host128`: 128 GiB host RAM: offload that does not fit the host dies in a train step;
* `foreign`: jobs whose own config FITS, on a GPU where another process holds 60% for the first
  two attempts; the best outcome is the user's config, unchanged, after waiting;
* `library`: a 3 GiB library workspace (cuBLAS/MIOpen) outside PyTorch's cache: without a cap
  the library's own allocation fails (CUBLAS_STATUS_ALLOC_FAILED, no PyTorch numbers); with
  memory_fraction PyTorch gets 0.88 of the GPU and fails itself when its peak is larger.
* `bighost`: room for ZeRO-3 parameter offload: 2 TiB of host RAM of which other processes hold
  256 GiB all night (a shared box), 70B full fine-tunes on one 24-192 GiB GPU included. Memory
  that others hold must never refuse a job (at most a bounded wait, `host_wait`), and a job the
  box can run must not be refused.

Every scenario runs the daemon's order: the refusal (`LR.infeasible`) before attempt 1, then
the climb. Refusals are printed as their own line: true (an infeasible job refused) and false (a
runnable job refused: a night lost for nothing).

Host memory of offload is DeepSpeed's accounting (fp32 master weights, gradients and Adam state,
16 B per trainable parameter, + 2 B per offloaded 16-bit weight) x 1.35 for pinned buffers: ~0.9
of DeepSpeed's own 1.5x estimate, consistent with the reported host OOM of a job estimated at
~156 GiB on a 128 GiB box.

With `--learned`, each scenario also reports learned plans (supervisor/policy/learn.py): the
first-attempt fit rate and the cost (best feasible throughput / that of the configuration the
job ends at, >= 1) without observations (the job as submitted, climbing the ladder), with the
estimator alone as a first-attempt plan, and after ONE night of a job of the same kind: the same
job (`same_job`), the same model at another cutoff_len (`other_seq`), the nearest model size with
the same vocabulary (`sibling`). The night's observations are built by `LO.observation` from
the simulator's truth (a fit's true peak; an OOM's diagnosis, a lower bound).
It then runs the whole grid for two nights in ONE observation store, as a daemon would (jobs in a
fixed shuffled order; each first attempt learns from every earlier job of its GPU, world size and
fine-tuning type, siblings and other sequence lengths included): `night1` / `night2` give the
first-attempt fit rate, the cost (median, p90) and the share of jobs above 1.25x the best.

With `--nights`, only the two nights, with the bench split once into a development part and a
held-out part (`part_of`: a hash of the job's model, cutoff_len and GPU, ~35% of those groups,
plus a grid of model shapes, sequence lengths, GPUs and host sizes the policy was never tuned on,
HELDOUT_*, run in a store of its own): per part and night the first-attempt fit rate and cost
median / max against the best feasible configuration, and per case the jobs night 2 does worse
on (night 1 fitted and night 2 did not; night 2's final configuration costs more). Held-out
cases are counted, listed only with `--show-heldout`: rules are written from development cases.

    python bench/bench_policy.py [--policy default] [--json] [--scenario NAME] [--learned | --nights]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import itertools
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from supervisor.core.models import (
    AttemptRecord,
    Category,
    DecisionKind,
    Diagnosis,
    ExitRecord,
    JobContext,
    Overrides,
    Phase,
)
from supervisor.judge.policy import BUILTIN_POLICY_DIR, decide, learn, load_policy
from supervisor.judge.policy import observed as LO
from supervisor.judge.policy import refusal as LR
from supervisor.judge.policy.estimate import shape_from_config
from supervisor.judge.policy.rungs import view_of

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
# The held-out grid (`--nights`): shapes, sequence lengths, GPUs and hosts the policy was never tuned
# on, from the same simulator. Llama-3.2-1B and Qwen2.5-7B share a vocabulary with grid models
# (siblings to learn from), gemma-2-9b and Yi-34B with none.
HELDOUT_MODELS = {
    "1B": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, vocab_size=128256,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944, vocab_size=152064,
               num_attention_heads=28, num_key_value_heads=4),
    "9B": dict(hidden_size=3584, num_hidden_layers=42, intermediate_size=14336, vocab_size=256000,
               num_attention_heads=16, num_key_value_heads=8, head_dim=256, tie_word_embeddings=True),
    "34B": dict(hidden_size=7168, num_hidden_layers=60, intermediate_size=20480, vocab_size=64000,
                num_attention_heads=56, num_key_value_heads=8),
}
HELDOUT_SEQ_LENS = (1536, 3072, 6144)
HELDOUT_GPU_GIB = (40, 64, 96)
HELDOUT_HOST_GIB = (64, 256, 1024)  # where the scenario does not set the host
SEQ_LENS = (1024, 2048, 4096, 8192)
GPU_GIB = (24, 48, 80, 192)
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
    world: int = 1  # GPUs LLaMA-Factory launches on (no `gpus:` in the job)
    host_gib: int = 512
    ds_explicit: bool = False  # a DeepSpeed JSON with explicit batch fields
    foreign_attempts: int = 0  # attempts during which another process holds 60% of the GPU
    library_gib: float = 0  # a library workspace (cuBLAS/MIOpen) allocated outside PyTorch's cache
    host_others_gib: int = 0  # host RAM other processes hold all night

    @property
    def host_ram(self) -> int:
        return self.host_gib * GiB


@dataclass(frozen=True)
class Config:
    micro: int
    accum: int
    gc: int  # 0 off, 1 on, 2 on + activations offloaded (unsloth)
    zero: int  # 0 none, 1 ZeRO-3 + optimizer offload, 2 + parameter offload
    allocator: bool
    seq: int | None = None  # cutoff_len when a data-changing policy shortened it
    cap: bool = False  # PyTorch capped at CAP_FRACTION of the GPU (memory_fraction)


def config_of(case: Case, ov: Overrides, ctx: JobContext) -> Config:
    v = view_of(ctx, ov)
    gc = 0 if not v.gc_on else (2 if v.unsloth_gc else 1)
    zero = 0 if v.setup.zero_stage != 3 else (2 if v.setup.offload_param else 1)
    capped = ("per_process_memory_fraction" in ov.env.get("PYTORCH_CUDA_ALLOC_CONF", "")
              or "OOM_SUPERVISOR_MEMORY_FRACTION" in ov.env)
    return Config(v.micro, v.accum, gc, zero, "PYTORCH_CUDA_ALLOC_CONF" in ov.env,
                  v.cutoff if v.cutoff != case.seq else None, capped)


def model_config(name: str) -> dict:
    return MODELS[name] if name in MODELS else HELDOUT_MODELS[name]


@functools.cache
def shape_of(name: str):
    return shape_from_config(model_config(name))


def true_memory(case: Case, cfg: Config) -> tuple[int, int, int, int]:
    """(gpu_peak_bytes, host_bytes, weights_on_gpu_at_load, largest_single_allocation)."""
    shape = shape_of(case.model)
    p, lil = shape.params, shape.largest_layer_params
    t = 1.0 if case.finetuning == "full" else LORA_SHARE
    trainable, frozen = p * t, p * (1 - t)
    w = case.world
    if cfg.zero == 0:
        states, host, weights = 16 * trainable + 2 * frozen, 0, 2 * p
    elif cfg.zero == 1:
        states, host, weights = 2 * p / w + 4 * lil + 0.6 * GiB, 16 * trainable * 1.35, 2 * p / w
    else:
        states, host, weights = 4 * lil + 1.2 * GiB, (16 * trainable + 2 * p) * 1.35, 4 * lil
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
    shape = shape_of(case.model)
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


def fits(case: Case, cfg: Config, held_by_others: int = 0) -> tuple[bool, Diagnosis | None]:
    cap = case.gpu_gib * GiB - held_by_others
    peak, host, weights, largest = true_memory(case, cfg)
    if host > case.host_ram - case.host_others_gib * GiB:
        return False, Diagnosis(Category.HOST_OOM, "DefaultCPUAllocator: can't allocate memory", vendor="cpu",
                                phase=Phase.TRAIN_STEP if cfg.zero == 1 else Phase.MODEL_LOAD)
    lib = _library_verdict(case, cfg, peak, largest, cap)
    if lib is not None:
        return lib
    if peak <= cap:
        return True, None
    if held_by_others:
        free = int(0.3 * GiB)
        return False, Diagnosis(Category.GPU_OOM, "CUDA out of memory", vendor="cuda", phase=Phase.MODEL_LOAD,
                                numbers={"total_capacity": case.gpu_gib * GiB, "free": free,
                                         "tried_to_allocate": min(largest, peak - cap + free),
                                         "held_by_others": held_by_others})
    free = int(0.3 * GiB)
    phase = Phase.MODEL_LOAD if weights + OVERHEAD > cap else Phase.TRAIN_STEP
    frag = case.fragmented and not cfg.allocator and peak / (1 + FRAG_SHARE) <= cap
    numbers = {"total_capacity": cap, "free": free,
               "tried_to_allocate": min(largest, peak - cap + free) if phase == Phase.TRAIN_STEP
               else min(weights + OVERHEAD - cap + free, 4 * shape_of(case.model).largest_layer_params)}
    if frag:
        numbers["reserved_unallocated"] = int(peak - peak / (1 + FRAG_SHARE))
    return False, Diagnosis(Category.GPU_OOM, "HIP out of memory", vendor="hip", phase=phase,
                            numbers=numbers, fragmentation=frag)


CAP_FRACTION = 0.88  # the shipped policies' memory_fraction
CACHE_SLACK = 1.10  # freed blocks PyTorch's cache keeps reserved over the live peak


def _library_verdict(case: Case, cfg: Config, peak: int, largest: int, cap: int) -> tuple[bool, Diagnosis | None] | None:
    """With a library workspace outside PyTorch's cache. The cache keeps freed blocks reserved
    (CACHE_SLACK over the live peak; allocator tuning returns most of it) and a library's own
    cudaMalloc does not make PyTorch release them, so the library fails (its own text, no
    PyTorch numbers) when reserved + workspace exceed the GPU. A cap bounds what PyTorch
    reserves at CAP_FRACTION of the GPU; its live peak must fit under the cap."""
    if not case.library_gib:
        return None
    w = int(case.library_gib * GiB)
    reserved = int(peak * (1.03 if cfg.allocator else CACHE_SLACK))
    library_oom = Diagnosis(Category.GPU_OOM, "CUBLAS_STATUS_ALLOC_FAILED", vendor="cuda", subkind="cublas",
                            phase=Phase.TRAIN_STEP)
    if cfg.cap:
        allowed = int(CAP_FRACTION * cap)
        if peak > allowed:
            return False, Diagnosis(Category.GPU_OOM, "CUDA out of memory", vendor="cuda", phase=Phase.TRAIN_STEP,
                                    numbers={"total_capacity": cap, "free": cap - allowed, "allowed": allowed,
                                             "tried_to_allocate": min(largest, peak - allowed + int(0.3 * GiB))})
        reserved = min(reserved, allowed)
    elif peak > cap:
        return None  # PyTorch itself runs out first: the ordinary OOM
    if reserved + w > cap:
        return False, library_oom
    return True, None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.cache
def best_feasible(case: Case) -> tuple[Config, float] | None:
    per_device = case.micro * case.accum
    best = None
    caps = (False, True) if case.library_gib else (False,)
    for micro, gc, zero, alloc, capped in itertools.product(_divisors(per_device), (0, 1, 2), (0, 1, 2),
                                                            (False, True), caps):
        if gc < (1 if case.gc_on else 0):
            continue  # the policy never turns checkpointing off
        cfg = Config(micro, per_device // micro, gc, zero, alloc, None, capped)
        if fits(case, cfg)[0]:
            thr = throughput(case, cfg)
            if best is None or thr > best[1]:
                best = (cfg, thr)
    return best


def user_deepspeed(case: Case) -> dict | None:
    if not case.ds_explicit:
        return None
    return {"train_micro_batch_size_per_gpu": case.micro, "gradient_accumulation_steps": case.accum,
            "train_batch_size": case.micro * case.accum * case.world, "zero_optimization": {"stage": 0}}


def refused_pair(case: Case, ov: Overrides, ctx: JobContext) -> str | None:
    """What transformers' fill_match would refuse in the launched YAML + DeepSpeed JSON (the
    simulator's own copy of the rule, not the policy's validator)."""
    ds = ov.deepspeed if ov.deepspeed is not None else user_deepspeed(case)
    if not ds:
        return None
    v = view_of(ctx, ov)
    want = {"train_micro_batch_size_per_gpu": v.micro, "gradient_accumulation_steps": v.accum,
            "train_batch_size": v.micro * v.accum * case.world}
    bad = [f"ds {k}={ds[k]} vs hf {want[k]}" for k in want if ds.get(k) not in (None, "auto") and ds[k] != want[k]]
    return "; ".join(bad) or None


def context_of(case: Case) -> JobContext:
    shape = shape_of(case.model)
    config = {"model_name_or_path": f"/models/{case.model}", "stage": "sft", "finetuning_type": case.finetuning,
              "per_device_train_batch_size": case.micro, "gradient_accumulation_steps": case.accum,
              "cutoff_len": case.seq, "bf16": True, "disable_gradient_checkpointing": not case.gc_on}
    if case.ds_explicit:
        config["deepspeed"] = "ds_z0_explicit.json"
    return JobContext(id=1, name=_label(case), kind="llamafactory", config=config, world_size=1, max_attempts=10,
                     param_count=shape.params, largest_layer_params=shape.largest_layer_params,
                     gpu_capacity_bytes=case.gpu_gib * GiB, host_ram_bytes=case.host_ram,
                     model_shape=None if NO_SHAPE else {"hidden_size": shape.hidden_size,
                                                        "num_layers": shape.num_layers,
                                                        "vocab_size": shape.vocab_size},
                     torch_version="2.14.1", transformers_version="5.6.0",
                     deepspeed_config=user_deepspeed(case), visible_gpu_count=case.world,
                     host_used_by_others_bytes=case.host_others_gib * GiB or None)


try:  # the bounded wait for host RAM that others hold (absent on older code: no wait)
    from supervisor.judge.policy.hostwait import host_wait
except ImportError:  # pragma: no cover
    host_wait = None


def waits_before(case: Case, policy, ov: Overrides, ctx: JobContext) -> int:
    """How many times the daemon would hold this attempt back for host RAM others hold (they hold
    it all night here, so the bound runs out and the attempt starts anyway)."""
    if host_wait is None:
        return 0
    waited, n = 0.0, 0
    while True:
        w = host_wait(ctx, policy, ov, waited_s=waited)
        if w is None or not w.wait:
            return n
        n += 1
        waited += w.retry_in_s
        if n > 1000:
            raise AssertionError(f"host_wait never ends: {w}")



def run_case(case: Case, policy, start: Overrides | None = None, observations=(), refuse: bool = True) -> dict:
    """Refuse (LR.infeasible, as the daemon does before attempt 1), then climb from `start`
    (the job as submitted by default) until a configuration fits; `trail` keeps every attempt
    (overrides, diagnosis or None when it fit, simulated config)."""
    ctx = context_of(case)
    if refuse:
        why = LR.infeasible(ctx, policy, list(observations))
        if why:
            return {"fit": False, "failed_escalations": 0, "rungs": [], "refused": True, "reason": why}
    history: list[AttemptRecord] = []
    ov = start or Overrides()
    rungs: list[str] = []
    trail: list[tuple[Overrides, Diagnosis | None, Config]] = []
    waits = 0
    for n in range(1, 20):
        cfg = config_of(case, ov, ctx)
        waits += waits_before(case, policy, ov, ctx)
        launched = int(ov.env.get("NPROC_PER_NODE", case.world))
        if launched != case.world:
            return {"fit": False, "failed_escalations": n - 1, "rungs": rungs, "world_changed": True,
                    "reason": f"remedy launched {launched} ranks instead of {case.world}: effective batch changed"}
        refused = refused_pair(case, ov, ctx)
        held = int(0.6 * case.gpu_gib * GiB) if n <= case.foreign_attempts else 0
        if refused:
            diag = Diagnosis(Category.CONFIG_ERROR, f"Please correct the following DeepSpeed config values that "
                                                    f"mismatch TrainingArguments values: {refused}")
            ok = False
        else:
            ok, diag = fits(case, cfg, held)
        trail.append((ov, None if ok else diag, cfg))
        if ok:
            # Attempts the other process's memory made fail are not the policy's failures.
            failed = max(0, n - 1 - case.foreign_attempts) if case.foreign_attempts else n - 2
            return {"fit": True, "failed_escalations": failed, "config": cfg, "rungs": rungs,
                    "changed": bool(ov.rungs), "trail": trail, "first_fit": n == 1, "waits": waits}
        history.append(AttemptRecord(n, ov, diag, ExitRecord(1)))
        d = decide(ctx, history, diag, policy)
        if d.kind == DecisionKind.RETRY:
            rungs.append("retry")
            continue
        if d.kind != DecisionKind.ESCALATE:
            return {"fit": False, "failed_escalations": n - 1, "reason": d.reason, "rungs": rungs, "trail": trail}
        rungs.append(d.rung)
        ov = d.overrides
    return {"fit": False, "failed_escalations": 19, "reason": "loop", "rungs": rungs}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


SCENARIOS = {
    "base": {},
    "world8": {"world": 8},
    "ds_explicit": {"ds_explicit": True},
    "host128": {"host_gib": 128},
    "foreign": {"foreign_attempts": 2},
    "library": {"library_gib": 3},
    "bighost": {"host_gib": 2048, "host_others_gib": 256},
}


def cases_for(scenario: str, grid: str = "tuned"):
    """The scenario's cases on the grid the policy was tuned on (`tuned`) or on the held-out grid
    of new shapes (`new`: HELDOUT_*; the host, where the scenario leaves it, by the case's hash)."""
    extra = SCENARIOS[scenario]
    dims = ((MODELS, SEQ_LENS, GPU_GIB) if grid == "tuned" else (HELDOUT_MODELS, HELDOUT_SEQ_LENS, HELDOUT_GPU_GIB))
    for model, seq, gpu, ft, gc_on, frag in itertools.product(*dims, ("full", "lora"), (True, False), (False, True)):
        case = Case(model, seq, gpu, ft, gc_on, frag, **extra)
        if grid != "tuned" and "host_gib" not in extra:
            case = dataclasses.replace(case, host_gib=HELDOUT_HOST_GIB[_hash(_identity(case)) % len(HELDOUT_HOST_GIB)])
        user_fits = fits(case, Config(case.micro, case.accum, 1 if gc_on else 0, 0, False))[0]
        # foreign: only jobs that fit on a free GPU; elsewhere: only jobs that need a remedy
        if user_fits == (scenario == "foreign"):
            yield case


HELDOUT_PERCENT = 35


def _hash(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)


def _identity(case: Case) -> str:
    """The case as its fields that differ from their defaults: a field added later with a default
    moves no case."""
    return "|".join(f"{f.name}={getattr(case, f.name)}" for f in dataclasses.fields(case)
                    if getattr(case, f.name) != f.default)


def part_of(case: Case) -> str:
    """Split once by a hash nobody chooses, as bench_classifier.part_of does for threads: a job's
    variants (fine-tuning type, checkpointing, fragmentation, scenario) fall together with their
    model, cutoff_len and GPU, adding cases never moves one, and about HELDOUT_PERCENT% of the
    tuned grid is held out. Every case of the new-shape grid is held out."""
    if case.model not in MODELS or case.seq not in SEQ_LENS or case.gpu_gib not in GPU_GIB:
        return "heldout"
    return "heldout" if _hash(f"{case.model}|{case.seq}|{case.gpu_gib}") % 100 < HELDOUT_PERCENT else "dev"


def summarise(scenario: str, policy) -> tuple[dict, list[dict]]:
    results = []
    for case in cases_for(scenario):
        best = best_feasible(case)
        if scenario == "foreign":  # the job fits as it is: unchanged is the best outcome
            user = Config(case.micro, case.accum, 1 if case.gc_on else 0, 0, False)
            best = (user, throughput(case, user))
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
        "scenario": scenario,
        "policy": policy.name,
        "cases": len(results),
        "feasible": len(feasible),
        "fitted": len(fitted),
        "fit_rate": round(len(fitted) / len(feasible), 3) if feasible else None,
        "feasible_but_gave_up": len(missed),
        "infeasible_and_failed_honestly": infeasible_failed,
        "world_size_changed": sum(1 for r in results if r.get("world_changed")),
        "refusals": f"true {sum(1 for r in results if r.get('refused') and not r['feasible'])}, "
                    f"false {sum(1 for r in results if r.get('refused') and r['feasible'])}",
        "waited_for_host_ram": sum(1 for r in results if r.get("waits")),
        "job_changed_though_it_fits": sum(1 for r in fitted if r.get("changed")) if scenario == "foreign" else None,
        "failed_escalations_median": statistics.median(esc) if esc else None,
        "failed_escalations_p90": pct(esc, 0.9) if esc else None,
        "failed_escalations_max": max(esc) if esc else None,
        "chose_shorter_cutoff": sum(1 for r in fitted if r["config"].seq),
        "throughput_vs_best_median": round(statistics.median(ratios), 3) if ratios else None,
        "throughput_vs_best_p10": round(pct(ratios, 0.1), 3) if ratios else None,
        "share_within_10pct_of_best": round(sum(r >= 0.9 for r in ratios) / len(ratios), 3) if ratios else None,
    }
    return summary, results


SIM_HOST_BASE = 2 * GiB  # host RSS of a simulated process besides offloaded states


def observations_of(case: Case, trail) -> list:
    """What the observation store would hold after one night of `case` (LO.observation on the
    simulator's truth: a fit's true peak, an OOM's diagnosis and the box's RAM)."""
    ctx = context_of(case)
    out = []
    for n, (ov, diag, cfg) in enumerate(trail, 1):
        peak, host, _, _ = true_memory(case, cfg)
        gpu = None if diag is not None else LO.GpuPeak(peak, peak, case.gpu_gib * GiB, "sim", 1)
        o = LO.observation(ctx, ov, diag, succeeded=diag is None, peak=gpu,
                              peak_rss_bytes=case.host_ram if diag is not None and diag.category == Category.HOST_OOM
                              else host + SIM_HOST_BASE, job=ctx.name, attempt=n, time=float(n))
        if o is not None:
            out.append(o)
    return out


def _source(case: Case, how: str) -> Case | None:
    """The earlier run a job learns from: itself, the same model at another cutoff_len, or the
    nearest model size with the same vocabulary (a sibling)."""
    import dataclasses

    if how == "same_job":
        return case
    if how == "other_seq":
        i = SEQ_LENS.index(case.seq)
        return dataclasses.replace(case, seq=SEQ_LENS[i - 1] if i else SEQ_LENS[1])
    names = list(MODELS)
    vocab = model_config(case.model)["vocab_size"]
    sibs = [m for m in names if m != case.model and MODELS[m]["vocab_size"] == vocab]
    if not sibs:
        return None
    near = min(sibs, key=lambda m: abs(names.index(m) - names.index(case.model)))
    return dataclasses.replace(case, model=near)


def learned_figures(policy, scenario: str = "base") -> dict:
    """First-attempt fit and cost (best feasible throughput / the configuration the job ends
    at, >= 1) without observations and after one night of a job of the same kind."""
    out: dict = {}
    cases = [c for c in cases_for(scenario) if best_feasible(c) is not None]
    without_fit, without_cost = [], []
    for case in cases:
        best = best_feasible(case)[1]
        r = run_case(case, policy)
        without_fit.append(r.get("first_fit", False))
        if r["fit"]:
            without_cost.append(best / throughput(case, r["config"]))
    out["without"] = {"cases": len(cases), "first_attempt_fit": round(sum(without_fit) / len(cases), 3),
                      "cost_median": round(statistics.median(without_cost), 3),
                      "cost_p90": round(pct(without_cost, 0.9), 3)}
    # Refusal at submit (LR.infeasible, no observations): a feasible job refused is a false refusal.
    every = list(cases_for(scenario))
    refused = [(best_feasible(c) is not None, LR.infeasible(context_of(c), policy, [])) for c in every]
    out["refusal"] = {"feasible_refused": sum(1 for f, why in refused if f and why),
                      "infeasible_refused": sum(1 for f, why in refused if not f and why),
                      "infeasible": sum(1 for f, _ in refused if not f)}
    # The estimator alone as a first-attempt plan (what learning corrects): its fastest
    # configuration predicted to fit, no observations.
    fit, cost = [], []
    for case in cases:
        pred = learn.predict(context_of(case), policy, [])
        chosen = pred.chosen if pred else None
        r = run_case(case, policy, chosen.overrides if chosen else None)
        fit.append(bool(r.get("first_fit")))
        if r["fit"]:
            cost.append(best_feasible(case)[1] / throughput(case, r["config"]))
    out["estimator_only"] = {"cases": len(cases), "first_attempt_fit": round(sum(fit) / len(cases), 3),
                             "cost_median": round(statistics.median(cost), 3), "cost_p90": round(pct(cost, 0.9), 3)}
    out.update(nights(policy, scenario))
    for how in ("same_job", "other_seq", "sibling"):
        fit, cost, n, reasons = [], [], 0, []
        for case in cases:
            src = _source(case, how)
            if src is None:
                continue
            night1 = run_case(src, policy)
            obs = observations_of(src, night1.get("trail", []))
            if not obs:
                continue
            n += 1
            start, why = learn.initial_overrides(context_of(case), policy, obs)
            r = run_case(case, policy, start, observations=obs)
            fit.append(bool(r.get("first_fit")))
            if r["fit"]:
                cost.append(best_feasible(case)[1] / throughput(case, r["config"]))
            if not r.get("first_fit") and len(reasons) < 2:
                reasons.append(f"{_label(case)}: {why}")
        out[how] = {"cases": n, "first_attempt_fit": round(sum(fit) / n, 3) if n else None,
                    "cost_median": round(statistics.median(cost), 3) if cost else None,
                    "cost_p90": round(pct(cost, 0.9), 3) if cost else None, "missed": reasons}
    return out


def _kind(case: Case) -> tuple:
    """What the daemon's store.similar() selects by: fine-tuning type, GPU, world size."""
    return case.finetuning, case.gpu_gib, case.world


def run_nights(policy, cases: list[Case], count: int = 2) -> dict[Case, list[dict]]:
    """`cases` `count` nights in a row in ONE observation store, as a daemon runs them (a fixed
    shuffled order): each job's refusal and first attempt see every observation of its kind so far
    (siblings, other sequence lengths and, from night 2 on, itself). Per case and night: fit,
    first_fit, refused and cost (best feasible throughput / the final configuration's; None
    when it did not fit or nothing is feasible)."""
    import random

    cases = list(cases)
    random.Random(16).shuffle(cases)
    store: dict[tuple, list] = {}
    best = {c: best_feasible(c) for c in cases}
    out: dict[Case, list[dict]] = {c: [] for c in cases}
    clock = 0
    for _night in range(count):
        for case in cases:
            pool = store.setdefault(_kind(case), [])
            start, _ = learn.initial_overrides(context_of(case), policy, pool)
            r = run_case(case, policy, start, observations=pool)
            cost = best[case][1] / throughput(case, r["config"]) if r["fit"] and best[case] else None
            out[case].append({"fit": r["fit"], "first_fit": bool(r.get("first_fit")), "refused": bool(r.get("refused")),
                              "feasible": best[case] is not None, "cost": cost})
            for o in observations_of(case, r.get("trail", [])):
                clock += 1
                pool.append(dataclasses.replace(o, time=float(clock)))
    return out


def nights(policy, scenario: str, count: int = 2) -> dict:
    """The tuned grid `count` nights in one store (run_nights): first-attempt fit and cost per night."""
    per_case = run_nights(policy, list(cases_for(scenario)), count)
    out = {}
    for night in range(count):
        rs = [runs[night] for runs in per_case.values() if runs[night]["feasible"]]
        cost = [r["cost"] for r in rs if r["cost"] is not None]
        n = len(rs)
        out[f"night{night + 1}"] = {
            "cases": n, "first_attempt_fit": round(sum(r["first_fit"] for r in rs) / n, 3) if n else None,
            "cost_median": round(statistics.median(cost), 3) if cost else None,
            "cost_p90": round(pct(cost, 0.9), 3) if cost else None,
            "above_1.25x": sum(1 for c in cost if c > 1.25), "runnable_refused": sum(r["refused"] for r in rs)}
    return out


# Night 2 costs more than night 1 when its final configuration is slower by more than float noise.
WORSE_TOLERANCE = 1e-6


def part_figures(per_case: dict[Case, list[dict]]) -> dict:
    """Night 1 and 2 over feasible cases: first-attempt fit, cost median and max, and the cases
    where night 2 is worse than night 1 (night 1 fitted and night 2 did not; night 2's final
    configuration costs more)."""
    rows = [(c, runs) for c, runs in per_case.items() if runs[0]["feasible"]]
    out: dict = {"cases": len(rows)}
    for night in (0, 1):
        cost = [runs[night]["cost"] for _, runs in rows if runs[night]["cost"] is not None]
        out[f"night{night + 1}"] = {
            "first_attempt_fit": round(sum(runs[night]["first_fit"] for _, runs in rows) / len(rows), 3) if rows else None,
            "fitted": sum(runs[night]["fit"] for _, runs in rows),
            "cost_median": round(statistics.median(cost), 3) if cost else None,
            "cost_max": round(max(cost), 3) if cost else None,
            "above_1.25x": sum(1 for c in cost if c > 1.25)}
    failed = [c for c, (a, b) in rows if a["fit"] and not b["fit"]]
    dearer = [(c, a["cost"], b["cost"]) for c, (a, b) in rows
              if a["cost"] is not None and b["cost"] is not None and b["cost"] > a["cost"] * (1 + WORSE_TOLERANCE)]
    out["night2_failed_where_night1_fit"] = [_label(c) for c in failed]
    out["night2_costs_more"] = [f"{_label(c)}: {a:.3f} -> {b:.3f}" for c, a, b in sorted(dearer, key=lambda t: t[1] - t[2])]
    return out


def sample(cases, share: int = 100) -> list[Case]:
    """`share`% of the cases, by a hash of each (nobody chooses; the same ones every run)."""
    return [c for c in cases if share >= 100 or _hash(_identity(c) + "|sample") % 100 < share]


def parts(policy, scenario: str, share: int = 100) -> dict:
    """Two nights of the tuned grid and, in a store of its own, of the new-shape grid (their GPUs
    differ, so no job of one is of the other's kind); figures per part: `dev`, `heldout` (the
    tuned grid's held-out share and the new-shape grid) and `heldout_new` (the new shapes alone)."""
    per_case = run_nights(policy, sample(cases_for(scenario), share))
    per_case.update(run_nights(policy, sample(cases_for(scenario, "new"), share)))
    new = {c for c in per_case if c.model not in MODELS}
    return {"dev": part_figures({c: r for c, r in per_case.items() if part_of(c) == "dev"}),
            "heldout": part_figures({c: r for c, r in per_case.items() if part_of(c) == "heldout"}),
            "heldout_new": part_figures({c: r for c, r in per_case.items() if c in new})}


def _label(c: Case) -> str:
    return f"{c.model} seq {c.seq} {c.gpu_gib} GiB {c.finetuning} gc={c.gc_on} frag={c.fragmented}"


PART_ROWS = (("first_attempt_fit", "first-attempt fit"), ("cost_median", "cost median"), ("cost_max", "cost max"),
             ("above_1.25x", "cost above 1.25x"), ("fitted", "fitted (any attempt)"))


def print_parts(policy, names: list[str], as_json: bool, show_heldout: bool, share: int = 100) -> int:
    """--nights: per scenario, night 1 and 2 of each part side by side, and the cases where night 2
    is worse than night 1 (held-out ones counted, listed only with --show-heldout)."""
    out = {}
    for name in names:
        fig = parts(policy, name, share)
        if not show_heldout:
            for part in ("heldout", "heldout_new"):
                for k in ("night2_failed_where_night1_fit", "night2_costs_more"):
                    fig[part][k] = len(fig[part][k])
        out[name] = fig
        if as_json:
            continue
        cols = ("dev", "heldout", "heldout_new")
        print(f"=== {name}: two nights in one store (cost = best feasible throughput / the final configuration's)")
        print(f"{'':>34}" + "".join(f"{c:>14}" for c in ("development", "held-out", "(new shapes)")))
        print(f"{'cases':>34}" + "".join(f"{fig[c]['cases']:>14}" for c in cols))
        for night in ("night1", "night2"):
            for key, words in PART_ROWS:
                print(f"{night + ' ' + words:>34}" + "".join(f"{fig[c][night][key]!s:>14}" for c in cols))
        for key, words in (("night2_failed_where_night1_fit", "night 2 failed where night 1 fit"),
                           ("night2_costs_more", "night 2 costs more than night 1")):
            vals = [fig[c][key] for c in cols]
            print(f"{words:>34}" + "".join(f"{v if isinstance(v, int) else len(v):>14}" for v in vals))
            for c in cols[:2]:
                for v in (fig[c][key] if isinstance(fig[c][key], list) else [])[:20]:
                    print(f"{'':>6}{c}: {v}")
        print()
    if as_json:
        print(json.dumps(out if len(out) > 1 else out[names[0]], indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="default")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-shape", action="store_true", help="withhold the model shape from the policy")
    ap.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    ap.add_argument("--learned", action="store_true",
                    help="also: first-attempt fit and cost without / with learned observations")
    ap.add_argument("--nights", action="store_true",
                    help="only: two nights in one store, the development and held-out parts side by side")
    ap.add_argument("--sample", type=int, default=100, metavar="PERCENT",
                    help="with --nights: run only this share of the cases (by hash; the test's subset)")
    ap.add_argument("--show-heldout", action="store_true",
                    help="with --nights: list the held-out cases where night 2 is worse (not to tune on)")
    args = ap.parse_args(argv)
    global NO_SHAPE
    NO_SHAPE = args.no_shape
    policy = load_policy(args.policy, search_dirs=[BUILTIN_POLICY_DIR])
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    if args.nights:
        return print_parts(policy, names, args.json, args.show_heldout, args.sample)
    out = {}
    for name in names:
        summary, results = summarise(name, policy)
        out[name] = summary
        if args.json:
            continue
        print(f"=== {name}")
        for k, v in summary.items():
            if v is not None:
                print(f"{k:>34}: {v}")
        fitted = [r for r in results if r["feasible"] and r["fit"]]
        missed = [r for r in results if r["feasible"] and not r["fit"]]
        print("worst throughput ratios:")
        for r in sorted(fitted, key=lambda r: r["ratio"])[:3]:
            print(f"  {_label(r['case'])}: {r['ratio']:.2f} via {r['rungs']} -> {r['config']} best {r['best']}")
        print("most failed escalations:")
        for r in sorted(fitted, key=lambda r: -r["failed_escalations"])[:3]:
            print(f"  {_label(r['case'])}: {r['failed_escalations']} via {r['rungs']}")
        for r in missed[:3]:
            print(f"  GAVE UP: {_label(r['case'])}: {r['reason'][:300]}")
        print()
    if args.learned:
        for name in names:
            fig = learned_figures(policy, name)
            out[f"{name}_learned"] = fig
            if args.json:
                continue
            print(f"=== {name}: learned plans (cost = best feasible throughput / the job's final configuration's)")
            for how, f in fig.items():
                print(f"{how:>10}: " + ", ".join(f"{k} {v}" for k, v in f.items() if k != "missed"))
                for m in f.get("missed", []):
                    print(f"{'':>12}missed: {m[:400]}")
            print()
    if args.json:
        print(json.dumps(out if len(out) > 1 else out[names[0]], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
