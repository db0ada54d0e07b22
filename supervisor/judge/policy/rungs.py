"""The remedies, one pure function each: (situation) -> a new Overrides, or why not.

Every rung states what it changes and what it costs (Overrides.notes) and,
where the memory picture is known, how many bytes it should free, so the
chooser can skip rungs that cannot close the shortfall.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from supervisor.core.models import Category, Diagnosis, JobContext, Overrides
from supervisor.intake.deepspeed_config import with_batch_fields, zero3_offload_config
from supervisor.judge.policy.allocator import ALLOC_VARS, format_alloc_conf, parse_alloc_conf
from supervisor.judge.policy.estimate import OPTIMISTIC_BUFFER, Setup, model_states
from supervisor.judge.policy.schema import Policy

# Diagnosis subkinds that mean "OOM outside PyTorch's caching allocator".
NON_CACHING_SUBKINDS = frozenset({"library", "driver", "cublas", "hip_runtime", "nccl", "rccl"})
MEMORY_FRACTION_ENV = "OOM_SUPERVISOR_MEMORY_FRACTION"
TRAINABLE_SHARE = {"full": 1.0, "freeze": 0.1, "lora": 0.01, "oft": 0.01}
# Activations kept with recomputation, as a share of those without (34*s*b*h per
# layer vs the layer inputs 2*s*b*h plus one recomputed layer, for ~32 layers).
CHECKPOINTED_SHARE = (2 * 32 + 34) / (34 * 32)


@dataclass(frozen=True)
class Memory:
    """What the failed attempt's numbers say about memory (bytes; None = unknown)."""

    shortfall: int | None = None
    capacity: int | None = None
    demand: int | None = None  # in use + the allocation that failed: a lower bound on the peak
    model_states: int | None = None
    activations: int | None = None
    reserved_unallocated: int | None = None
    # What PyTorch's allocator held when it failed (allocated + reserved-but-unallocated).
    pytorch_held: int | None = None


@dataclass(frozen=True)
class View:
    """The configuration an attempt ran with, read from user config + overrides."""

    config: Mapping[str, Any]
    micro: int
    accum: int
    eval_batch: int
    cutoff: int
    gc_on: bool
    unsloth_gc: bool
    setup: Setup
    ours_alloc: Mapping[str, str]


@dataclass(frozen=True)
class Applied:
    overrides: Overrides
    what: str  # what it changes and costs, in words
    frees: int | None = None  # estimated bytes freed on the GPU (None: unknown)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Skipped:
    why: str


def deepspeed_of(job: JobContext, ov: Overrides) -> Mapping[str, Any] | None:
    if ov.deepspeed is not None:
        return ov.deepspeed
    ds = getattr(job, "deepspeed_config", None)
    if ds is None and isinstance(job.config.get("deepspeed"), Mapping):
        ds = job.config["deepspeed"]
    return ds


def setup_of(job: JobContext, cfg: Mapping[str, Any], ds: Mapping[str, Any] | None) -> Setup:
    share = TRAINABLE_SHARE.get(str(cfg.get("finetuning_type", "lora")), 1.0)
    if not ds:
        return Setup(trainable_fraction=share)
    zero = ds.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        return Setup(trainable_fraction=share)

    def on(sect: str) -> bool:
        sub = zero.get(sect) or {}
        return isinstance(sub, Mapping) and str(sub.get("device", "none")) in ("cpu", "nvme")

    stage = zero.get("stage", 0)
    return Setup(zero_stage=int(stage) if str(stage).isdigit() else 0,
                 offload_optimizer=on("offload_optimizer"), offload_param=on("offload_param"),
                 trainable_fraction=share)


def cap_fraction(ov: Overrides) -> float | None:
    """The memory cap a configuration runs under (either mechanism), or None."""
    raw = parse_alloc_conf(ov.env.get(ALLOC_VARS[0])).get("per_process_memory_fraction") \
        or ov.env.get(MEMORY_FRACTION_ENV)
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


def host_budget(job: JobContext, policy: Policy) -> int | None:
    """The one host-RAM budget every remedy is judged against (bytes; None = unknown): the job's
    host_memory_limit, else the box's RAM less the policy's reserve. What other processes hold
    now is not subtracted: it is waited for before an attempt starts (hostwait.py), never a
    reason to choose another remedy or to refuse the job."""
    if job.host_memory_limit_bytes:
        return job.host_memory_limit_bytes
    if not job.host_ram_bytes:
        return None
    return int(job.host_ram_bytes * (1 - policy.host_ram_reserve))


def host_capacity(job: JobContext) -> int | None:
    """The most host RAM this job could ever have (bytes; None = unknown): its host_memory_limit,
    else the box's RAM. What other processes hold at the moment is not counted: it is weather,
    met by waiting (hostwait.py), never by refusing the job or changing it."""
    return job.host_memory_limit_bytes or job.host_ram_bytes or None


def host_budget_source(job: JobContext, policy: Policy) -> str:
    gib = 1 << 30
    if job.host_memory_limit_bytes:
        return f"its host_memory_limit {job.host_memory_limit_bytes / gib:.0f} GiB"
    return (f"{(job.host_ram_bytes or 0) / gib:.0f} GiB on the box, less {policy.host_ram_reserve:.0%} "
            "reserve; what other processes hold is waited for, not counted")


def without_gpu(job: JobContext, diag: Diagnosis | None = None) -> bool:
    """A run its launch shows no GPU (a CPU box, no `gpus:`): there the 'device' is host memory.
    A GPU OOM or a CUDA/HIP diagnosis is a GPU seen, whatever the probe said."""
    if diag is not None and (diag.category == Category.GPU_OOM or diag.vendor in ("cuda", "hip")):
        return False
    return job.visible_gpu_count == 0 and not job.gpus


NO_GPU = ("a run with no GPU: its 'device' is host memory, so this remedy, which acts on GPU memory only, "
          "would move nothing")


def pinned_nproc(job: JobContext) -> int | None:
    """NPROC_PER_NODE for a torchrun launch that keeps the ranks the job runs now, or None
    to leave LLaMA-Factory's own count (every visible GPU) alone. On a CPU-only box its count
    is 0 and torchrun would get `--nproc_per_node 0`, so 1 there."""
    if job.nproc_per_node:
        return job.nproc_per_node
    if job.gpus:
        return len(job.gpus)
    if job.visible_gpu_count is not None:
        return max(1, job.visible_gpu_count)
    return job.world_size if job.world_size > 1 else None


def view_of(job: JobContext, ov: Overrides) -> View:
    cfg = {**job.config, **ov.yaml}
    return View(
        config=cfg,
        micro=int(cfg.get("per_device_train_batch_size", 8)),
        accum=int(cfg.get("gradient_accumulation_steps", 1)),
        eval_batch=int(cfg.get("per_device_eval_batch_size", 8)),
        cutoff=int(cfg.get("cutoff_len", 2048)),
        gc_on=not bool(cfg.get("disable_gradient_checkpointing", False)),
        unsloth_gc=bool(cfg.get("use_unsloth_gc", False)),
        setup=setup_of(job, cfg, deepspeed_of(job, ov)),
        ours_alloc=parse_alloc_conf(ov.env.get(ALLOC_VARS[0])),
    )


def with_changes(ov: Overrides, rung: str, note: str, *, yaml: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None, deepspeed: Any = ...) -> Overrides:
    return Overrides(
        rungs=(*ov.rungs, rung),
        yaml={**ov.yaml, **(yaml or {})},
        env={**ov.env, **(env or {})},
        deepspeed=ov.deepspeed if deepspeed is ... else deepspeed,
        notes=(*ov.notes, f"{rung}: {note}"),
    )


def _alloc_env(ours: Mapping[str, str]) -> dict[str, str]:
    """Our allocator options under every name, and OPTIM_TORCH=0 so LLaMA-Factory's
    torchrun path does not overwrite PYTORCH_CUDA_ALLOC_CONF (it keeps its other
    optimisation, TORCH_NCCL_AVOID_RECORD_STREAMS, set here by hand)."""
    value = format_alloc_conf(ours)
    return {**dict.fromkeys(ALLOC_VARS, value), "OPTIM_TORCH": "0",
            "TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}


def _version_at_least(version: str | None, minimum: str) -> bool | None:
    if not version:
        return None
    try:
        have = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
        want = tuple(int(p) for p in minimum.split(".")[:2])
    except ValueError:
        return None
    return have >= want


# --- the rungs -------------------------------------------------------------------------


def allocator(job: JobContext, ov: Overrides, diag: Diagnosis, policy: Policy, mem: Memory) -> Applied | Skipped:
    if without_gpu(job, diag):
        return Skipped(f"{NO_GPU} (the CUDA/HIP caching allocator's settings)")
    s = policy.rungs.allocator
    v = view_of(job, ov)
    ours = dict(v.ours_alloc)
    steps: list[dict[str, str]] = [
        {"garbage_collection_threshold": str(s.garbage_collection_threshold), "max_split_size_mb": str(mb)}
        for mb in s.max_split_size_mb]
    if s.expandable_segments == "always" or (s.expandable_segments == "cuda" and diag.vendor == "cuda"):
        steps.append({"garbage_collection_threshold": str(s.garbage_collection_threshold),
                      "expandable_segments": "True"})
    if ours.get("expandable_segments") == "True":
        done = len(steps)
    elif "max_split_size_mb" in ours:
        done = 1 + next((i for i, st in enumerate(steps) if st.get("max_split_size_mb") == ours["max_split_size_mb"]), -1)
    else:
        done = 0
    if done >= len(steps):
        return Skipped("allocator settings already at their last step")
    if diag.subkind in NON_CACHING_SUBKINDS and "garbage_collection_threshold" in ours:
        # The early reclaim is what hands cached blocks back for a library's own allocation;
        # a smaller split size frees nothing outside PyTorch's cache.
        return Skipped("allocator already tuned (cached blocks reclaimed early); another split size "
                       "gives a library outside PyTorch's cache nothing")
    step = steps[done]
    for key in ("max_split_size_mb", "expandable_segments"):
        ours.pop(key, None)
    ours.update(step)
    if "expandable_segments" in step:
        what = ("expandable_segments:True (segments grow in place, so fragmentation cannot strand "
                "free memory; max_split_size no longer applies); no training change")
    else:
        what = (f"garbage_collection_threshold:{step['garbage_collection_threshold']}, "
                f"max_split_size_mb:{step['max_split_size_mb']} (blocks above the split size are not "
                "cut up, cached blocks are reclaimed early); no training change, a little allocator time")
    # It can only hand back memory PyTorch holds but cannot use: the reserved-but-
    # unallocated share. Without the fragmentation signal and with a measured
    # shortfall, count nothing on it.
    frees = mem.reserved_unallocated
    if frees is None and mem.shortfall is not None and not diag.fragmentation:
        frees = 0
    return Applied(with_changes(ov, "allocator", what, env=_alloc_env(ours)), what, frees)


def memory_fraction(job: JobContext, ov: Overrides, diag: Diagnosis, policy: Policy, mem: Memory) -> Applied | Skipped:
    if without_gpu(job, diag):
        return Skipped(f"{NO_GPU} (a cap on the GPU's memory)")
    s = policy.rungs.memory_fraction
    f = s.fraction
    cfg = {**job.config, **ov.yaml}
    if MEMORY_FRACTION_ENV in ov.env or "per_process_memory_fraction" in view_of(job, ov).ours_alloc:
        return Skipped("memory fraction already capped")
    headroom = int((1 - f) * mem.capacity) if mem.capacity else None
    frees = headroom if diag.subkind in NON_CACHING_SUBKINDS else 0
    if mem.capacity and mem.pytorch_held is not None and mem.pytorch_held > f * mem.capacity:
        # The fit check every remedy passes: a cap below what PyTorch needs moves the OOM into
        # PyTorch. Its reserved-but-unallocated share counts: it could not serve requests either.
        gib = 1 << 30
        return Skipped(f"a cap at {f:.0%} ({f * mem.capacity / gib:.1f} GiB) is below the "
                       f"~{mem.pytorch_held / gib:.1f} GiB PyTorch held (incl. "
                       f"{(mem.reserved_unallocated or 0) / gib:.1f} GiB reserved but unallocated): "
                       "PyTorch itself would run out")
    if job.uses_vllm:
        if "vllm_gpu_util" in ov.yaml:
            return Skipped("vllm_gpu_util already set")
        what = f"vllm_gpu_util: {f} (vLLM's engine keeps {1 - f:.0%} of the GPU free)"
        return Applied(with_changes(ov, "memory_fraction", what, yaml={"vllm_gpu_util": f}), what, frees)
    del cfg
    if _version_at_least(job.torch_version, s.env_option_min_torch):
        ours = {**view_of(job, ov).ours_alloc, "per_process_memory_fraction": str(f)}
        what = (f"per_process_memory_fraction:{f} in the allocator config: PyTorch caps its caching "
                f"allocator at {f:.0%} of the GPU, leaving headroom for libraries, the driver and "
                "transient peaks; no training change")
        return Applied(with_changes(ov, "memory_fraction", what, env=_alloc_env(ours)), what, frees)
    what = (f"torch.cuda.set_per_process_memory_fraction({f}) in every training process via the "
            "supervisor's startup hook (sitecustomize on PYTHONPATH, acts only once CUDA starts); "
            "no training change")
    return Applied(with_changes(ov, "memory_fraction", what, env={MEMORY_FRACTION_ENV: str(f)}), what, frees)


def _divisors_below(n: int, below: int) -> list[int]:
    return [d for d in range(below - 1, 0, -1) if n % d == 0]


def micro_batch_options(job: JobContext, ov: Overrides, policy: Policy) -> list[int]:
    """Every smaller micro-batch that keeps micro x accumulation exactly (largest first)."""
    v = view_of(job, ov)
    floor = policy.rungs.micro_batch.floor
    return [d for d in _divisors_below(v.micro * v.accum, v.micro) if d >= floor]


def micro_batch(job: JobContext, ov: Overrides, diag: Diagnosis, policy: Policy, mem: Memory,
                *, resuming: bool = False, margin: float = 1.0, target: int | None = None) -> Applied | Skipped:
    if job.kind != "llamafactory":
        return Skipped("not a LLaMA-Factory job")
    v = view_of(job, ov)
    floor = policy.rungs.micro_batch.floor
    if v.micro <= floor:
        return Skipped(f"micro-batch already {v.micro} (floor {floor})")
    # transformers < 5.2 restores the old per-device batch size on resume
    # (huggingface/transformers#43708); the resume plan (supervisor/checkpoints.py) patches
    # trainer_state.json for those versions, so the split applies either way.
    del resuming
    per_device = v.micro * v.accum
    options = [d for d in _divisors_below(per_device, v.micro) if d >= floor]
    if not options:
        return Skipped(f"no micro-batch below {v.micro} divides {v.micro} x {v.accum} = {per_device} "
                       "exactly, so the effective batch could not stay the same")
    new = next((d for d in options if d <= v.micro / 2), options[-1])
    if target is not None:
        if target not in options:
            return Skipped(f"micro-batch {target} does not split {per_device} exactly")
        new = target
    elif mem.activations is not None and mem.shortfall is not None:
        # The largest exact split that closes the shortfall, when the numbers tell.
        need = mem.shortfall * margin
        fitting = [d for d in options if mem.activations * (1 - d / v.micro) >= need]
        if fitting:
            new = fitting[0]
    accum = per_device // new
    world = job.launched_world_size()
    note = "" if new * 2 == v.micro else f" (the nearest exact split of {per_device})"
    what = (f"per_device_train_batch_size {v.micro} -> {new}, gradient_accumulation_steps {v.accum} -> "
            f"{accum}{note}: effective batch {v.micro}x{v.accum}x{world} = {new}x{accum}x{world} unchanged; "
            f"smaller kernels, some throughput lost")
    frees = int(mem.activations * (1 - new / v.micro)) if mem.activations is not None else None
    # An explicit batch field in the job's DeepSpeed JSON that kept the old split would make
    # transformers refuse the run (fill_match): the attempt gets a copy that agrees.
    ds = deepspeed_of(job, ov)
    synced = with_batch_fields(ds, micro=new, accum=accum, world_size=world) if ds else None
    if synced is not None:
        what += ("; the DeepSpeed config's explicit batch fields rewritten to match "
                 f"(train_micro_batch_size_per_gpu {new}, gradient_accumulation_steps {accum}, "
                 f"train_batch_size {new * accum * world}) in the attempt's ds_config.json")
    return Applied(with_changes(ov, "micro_batch", what, yaml={
        "per_device_train_batch_size": new, "gradient_accumulation_steps": accum},
        deepspeed=synced if synced is not None else ...), what, frees,
        {"micro": new, "accum": accum})


def eval_batch(job: JobContext, ov: Overrides, diag: Diagnosis, policy: Policy, mem: Memory) -> Applied | Skipped:
    if job.kind != "llamafactory":
        return Skipped("not a LLaMA-Factory job")
    v = view_of(job, ov)
    floor = policy.rungs.eval_batch.floor
    if v.eval_batch <= floor:
        return Skipped(f"eval batch already {v.eval_batch}")
    new = max(floor, v.eval_batch // 2)
    what = (f"per_device_eval_batch_size {v.eval_batch} -> {new}: evaluation takes longer; "
            "training untouched")
    return Applied(with_changes(ov, "eval_batch", what, yaml={"per_device_eval_batch_size": new}), what, None)


def grad_checkpointing(job: JobContext, ov: Overrides, diag: Diagnosis, policy: Policy, mem: Memory,
                       *, host_pressure: bool = False) -> Applied | Skipped:
    if job.kind != "llamafactory":
        return Skipped("not a LLaMA-Factory job")
    v = view_of(job, ov)
    if not v.gc_on:
        what = ("disable_gradient_checkpointing: false (recompute activations in the backward pass: "
                "several-fold less activation memory for ~20-30% more compute)")
        frees = int(mem.activations * (1 - CHECKPOINTED_SHARE)) if mem.activations is not None else None
        return Applied(with_changes(ov, "grad_checkpointing", what,
                                    yaml={"disable_gradient_checkpointing": False}), what, frees)
    if v.unsloth_gc or not policy.rungs.grad_checkpointing.allow_unsloth_gc:
        return Skipped("gradient checkpointing already on (LLaMA-Factory's default)")
    if host_pressure:
        return Skipped("use_unsloth_gc moves checkpoints to host RAM, which is what ran out")
    what = ("use_unsloth_gc: true (checkpointed layer inputs wait in host RAM instead of the GPU; "
            "extra PCIe traffic, a few percent slower)")
    frees = int(mem.activations * 0.6) if mem.activations is not None else None
    return Applied(with_changes(ov, "grad_checkpointing", what, yaml={"use_unsloth_gc": True}), what, frees)


def _zero3(job: JobContext, ov: Overrides, mem: Memory, policy: Policy, *, offload_param: bool,
           has_checkpoint: bool, host_check: str = "budget", diag: Diagnosis | None = None) -> Applied | Skipped:
    """ZeRO-3 with offload. Host RAM is judged twice: a remedy whose states cannot fit the box
    even under the most optimistic credible estimate (DeepSpeed's without its buffer factor) is
    impossible, always skipped; one whose buffered estimate exceeds the job's budget is
    skipped with host_check="budget" (a remedy that fits is preferred) and taken with
    "possible" (the last resort: tried, and what it really uses is learned)."""
    name = "zero3_offload_param" if offload_param else "zero3_offload_optimizer"
    if job.kind != "llamafactory":
        return Skipped("not a LLaMA-Factory job")
    if without_gpu(job, diag):
        return Skipped(f"{NO_GPU} (offload to the CPU; it would only add DeepSpeed and a launcher process)")
    v = view_of(job, ov)
    cur = v.setup
    if cur.zero_stage == 3 and cur.offload_optimizer and (cur.offload_param or not offload_param):
        return Skipped("already running ZeRO-3 with this offload")
    if has_checkpoint and cur.zero_stage != 3 and not policy.allow_restart_for_deepspeed:
        was = "without DeepSpeed" if cur.zero_stage == 0 else f"under ZeRO-{cur.zero_stage}"
        return Skipped(f"the checkpoints were written {was}; ZeRO-3 cannot load them "
                       "(set allow_restart_for_deepspeed to start over instead)")
    if (has_checkpoint and cur.zero_stage == 3 and not cur.offload_optimizer
            and not policy.allow_restart_for_deepspeed):
        # Measured (supervisor/checkpoints.py): the first step after loading dies with
        # KeyError 'bias_correction' in DeepSpeedCPUAdam; turning offload off, or toggling
        # parameter offload, resumes exactly.
        return Skipped("turning optimizer offload on cannot resume a ZeRO-3 checkpoint written without "
                       "it (DeepSpeedCPUAdam fails with KeyError 'bias_correction')")
    cfg = v.config
    ds = zero3_offload_config(offload_param=offload_param,
                              bf16=cfg.get("bf16") if "bf16" in cfg else None,
                              fp16=cfg.get("fp16") if "fp16" in cfg else None)
    new_setup = Setup(3, True, offload_param, cur.trainable_fraction)
    frees = None
    host_need = host_floor = None
    if job.param_count:
        lil = job.largest_layer_params or job.param_count // 40
        world = job.launched_world_size()
        gpu_now, _ = model_states(job.param_count, lil, world, cur)
        gpu_new, host_need = model_states(job.param_count, lil, world, new_setup)
        _, host_floor = model_states(job.param_count, lil, world, new_setup, buffer=OPTIMISTIC_BUFFER)
        frees = max(0, gpu_now - gpu_new)
    gib = 1 << 30
    capacity = host_capacity(job)
    if host_floor and capacity and host_floor > capacity:
        return Skipped(f"impossible here: even DeepSpeed's estimate without its buffer factor needs "
                       f"~{host_floor / gib:.0f} GiB host RAM, more than the {capacity / gib:.0f} GiB "
                       + ("of its host_memory_limit" if job.host_memory_limit_bytes else "the box has"))
    budget = host_budget(job, policy)
    over_budget = bool(host_need and budget is not None and host_need > budget)
    if over_budget and host_check == "budget":
        return Skipped(f"needs ~{host_need / gib:.0f} GiB host RAM; the job may use "
                       f"~{budget / gib:.0f} GiB ({host_budget_source(job, policy)})")
    what = ("DeepSpeed ZeRO-3, optimizer state " + ("and parameters " if offload_param else "")
            + "offloaded to pinned CPU memory (generated ds_config.json, overlap_comm on); "
            + ("much slower steps (every layer's weights cross PCIe each step)" if offload_param
               else "slower steps (~15%: the optimizer step runs on the CPU)"))
    if over_budget:
        what += (f"; DeepSpeed's estimate ~{host_need / gib:.0f} GiB host RAM (1.5x buffer) is above the "
                 f"~{budget / gib:.0f} GiB the job may use ({host_budget_source(job, policy)}), but "
                 f"~{(host_floor or 0) / gib:.0f} GiB without the buffer fits the box: tried, and what it "
                 "really uses is learned")
    elif host_need:
        what += f"; needs ~{host_need / gib:.0f} GiB host RAM"
    env = {"FORCE_TORCHRUN": "1"}
    nproc = pinned_nproc(job)
    if nproc is not None:
        env["NPROC_PER_NODE"] = str(nproc)
    return Applied(with_changes(ov, name, what, env=env, deepspeed=ds), what, frees,
                   {"host_need": host_need})


def zero3_offload_optimizer(job, ov, diag, policy, mem, *, has_checkpoint=False, host_check="budget"):
    return _zero3(job, ov, mem, policy, offload_param=False, has_checkpoint=has_checkpoint, host_check=host_check,
                  diag=diag)


def zero3_offload_param(job, ov, diag, policy, mem, *, has_checkpoint=False, host_check="budget"):
    return _zero3(job, ov, mem, policy, offload_param=True, has_checkpoint=has_checkpoint, host_check=host_check,
                  diag=diag)


def cutoff_len(job: JobContext, ov: Overrides, diag: Diagnosis, policy: Policy, mem: Memory) -> Applied | Skipped:
    if job.kind != "llamafactory":
        return Skipped("not a LLaMA-Factory job")
    if not policy.allow_data_changes:
        return Skipped("the policy does not allow changing the data")
    v = view_of(job, ov)
    s = policy.rungs.cutoff_len
    new = max(s.floor, int(v.cutoff * s.factor))
    if new >= v.cutoff:
        return Skipped(f"cutoff_len already {v.cutoff} (floor {s.floor})")
    what = (f"cutoff_len {v.cutoff} -> {new}: CHANGES THE DATA (longer samples are truncated); "
            "activations shrink with the sequence length")
    frees = int(mem.activations * (1 - new / v.cutoff)) if mem.activations is not None else None
    return Applied(with_changes(ov, "cutoff_len", what, yaml={"cutoff_len": new}), what, frees)


def _zero3_of(job: JobContext, ov: Overrides) -> tuple[Mapping[str, Any] | None, Mapping[str, Any]]:
    """The DeepSpeed config and its zero_optimization section when the run is ZeRO-3, else (None, {})."""
    ds = deepspeed_of(job, ov)
    zero = (ds or {}).get("zero_optimization") or {}
    if not ds or not isinstance(zero, Mapping) or str(zero.get("stage", 0)) != "3":
        return None, {}
    return ds, zero


def universal_load(job: JobContext, ov: Overrides, diag: Diagnosis, policy: Policy, mem: Memory) -> Applied | Skipped:
    """A load-time remedy for ZeRO-3: read the checkpoint through DeepSpeed's universal format
    (parameter by parameter) and without the old rank 0's whole optimizer file, which DeepSpeed's
    universal loader otherwise keeps in host memory on EVERY rank while it loads
    (stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3). Measured on 2 CPU ranks: the
    load that ran out of a 3,060 MiB limit passes under it, losses identical. Training unchanged."""
    if job.kind != "llamafactory":
        return Skipped("not a LLaMA-Factory job")
    if not policy.allow_universal_checkpoint:
        return Skipped("the policy does not allow universal checkpoints (allow_universal_checkpoint)")
    if "universal_load" in ov.rungs:
        return Skipped("already loading through the universal format, without the old optimizer file")
    ds, _ = _zero3_of(job, ov)
    if ds is None:
        return Skipped("no DeepSpeed ZeRO-3 checkpoint to load another way (a lean universal load is "
                       "measured for ZeRO-3 only)")
    section = ds.get("checkpoint") if isinstance(ds.get("checkpoint"), Mapping) else {}
    new = {**ds, "checkpoint": {**section, "load_universal": True}}
    what = ("load the ZeRO-3 checkpoint through DeepSpeed's universal format (ds_to_universal before launch, "
            "checkpoint.load_universal in the attempt's ds_config.json) with its zero/optimizer_state.pt slimmed to "
            "the step and param groups the loader reads: no rank holds the old rank 0's whole optimizer state "
            "while it loads; no training change")
    return Applied(with_changes(ov, "universal_load", what, deepspeed=new), what, None)


GATHER_KEY = "stage3_gather_16bit_weights_on_model_save"


def sharded_save(job: JobContext, ov: Overrides, diag: Diagnosis, policy: Policy, mem: Memory) -> Applied | Skipped:
    """A save-time remedy for ZeRO-3 full fine-tunes: checkpoints without the 16-bit weights gathered
    onto rank 0 (GATHER_KEY false). With it on, every save (transformers' save_model through
    accelerate's get_state_dict) assembles the whole model on rank 0, layer by layer on its GPU and
    then in its host RAM: an OOM there is the save's, and a smaller micro-batch changes nothing of it.
    Without it each rank writes only its own shard, which is what a resume loads (global_stepN), and
    the weights come from the zero_to_fp32.py DeepSpeed writes beside them. A PEFT adapter's save
    gathers only the adapter whatever the key says (transformers calls
    _zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)), so it is no remedy there."""
    if job.kind != "llamafactory":
        return Skipped("not a LLaMA-Factory job")
    if not policy.allow_sharded_save:
        return Skipped("the policy does not allow checkpoints without consolidated weights (allow_sharded_save)")
    ds, zero = _zero3_of(job, ov)
    if ds is None:
        return Skipped("not DeepSpeed ZeRO-3: its saves gather no 16-bit weights")
    if str(view_of(job, ov).config.get("finetuning_type", "lora")) == "lora":
        return Skipped("a LoRA adapter's save gathers only the adapter, whatever the config says")
    if zero.get(GATHER_KEY) is not True and str(zero.get(GATHER_KEY)).lower() != "true":
        return Skipped(f"already saving without the 16-bit gather ({GATHER_KEY} is not true)")
    new = {**ds, "zero_optimization": {**zero, GATHER_KEY: False}}
    what = (f"save checkpoints without gathering the 16-bit weights onto rank 0 ({GATHER_KEY} false in the "
            "attempt's ds_config.json): each rank writes its own shard, which is what a resume loads; "
            "checkpoints and the final model then hold no model.safetensors: the weights come from the "
            "zero_to_fp32.py DeepSpeed writes beside them; no training change")
    return Applied(with_changes(ov, "sharded_save", what, deepspeed=new), what, None)
