"""How the next attempt continues from a checkpoint: pure decisions over what a scan found.

`supervisor.run.checkpoints` reads output folders into these records (`Checkpoint`, `Scan`) and
carries out the plans (`apply_fixups`, `quarantine`, `reclaim`); everything here is a function
of its arguments. The compatibility rules behind `plan_resume` are in that module's docstring.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRAINER_STATE = "trainer_state.json"
ARCHIVE_DIR = ".supervisor-archive"
TRAINER_STATE_BACKUP = "trainer_state.json.supervisor-orig"
# transformers >= 5.2 no longer restores the checkpoint's per-device batch size on resume
# (huggingface/transformers#43708); before that, `Trainer.train` does
# `self._train_batch_size = state.train_batch_size` whenever trainer_state.json has it.
BATCH_SIZE_RESTORE_FIXED_IN = (5, 2)
_ADAPTER_METHODS = ("lora", "oft")  # LLaMA-Factory methods that save a PEFT adapter


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Checkpoint:
    """A complete `checkpoint-N` folder, described from its files alone.

    `zero_stage` comes from the shard layout: 3 for ZeRO-3 (per-rank model states), 2 for the
    ZeRO-1/2 layout (the two cannot be told apart by name), 0 for DeepSpeed without ZeRO
    partitioning, None without DeepSpeed. `world_size` counts the ranks whose files are present
    (RNG states, and under DeepSpeed optimizer shards). `train_batch_size` is the per-device batch
    trainer_state.json recorded; do not read it as what the run used: transformers 5.6 carries a
    resumed checkpoint's value forward into later checkpoints even after a micro-batch change.
    """

    path: Path
    step: int
    deepspeed: bool
    zero_stage: int | None
    world_size: int | None
    train_batch_size: int | None
    has_weights: bool  # consolidated weights or a LoRA adapter (usable without DeepSpeed)
    adapter: bool
    has_optimizer: bool
    ds_tag: str | None = None
    max_steps: int | None = None
    fsdp: str | None = None  # "sharded" | "full" | "local" (the FSDP state-dict type), else None
    # Sizes on disk (bytes) of the optimizer state (optimizer.pt, or every rank's ZeRO shard) and of
    # its largest file: what loading it must hold in memory (judge.load_check). None: not measured.
    optimizer_bytes: int | None = None
    largest_optimizer_file: int | None = None


@dataclass(frozen=True)
class Incomplete:
    """A `checkpoint-N` folder that must not be resumed from, and why."""

    path: Path
    step: int | None
    reason: str


@dataclass(frozen=True)
class Scan:
    complete: tuple[Checkpoint, ...]
    incomplete: tuple[Incomplete, ...]

    @property
    def latest(self) -> Checkpoint | None:
        return max(self.complete, key=lambda c: c.step, default=None)


@dataclass(frozen=True)
class RunShape:
    """What about a run decides whether a checkpoint's optimizer state can be loaded."""

    deepspeed_stage: int | None
    offload_optimizer: bool
    offload_param: bool
    world_size: int
    micro_batch: int
    grad_accum: int
    finetuning_type: str
    load_universal: bool = False  # its DeepSpeed config reads checkpoints in the universal format
    lean_load: bool = False  # a universal load without the old rank 0's whole optimizer file (universal_load)
    round_robin: bool = False  # ZeRO-1/2 `round_robin_gradients` (universal is wrong with it on > 1 rank)

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size


@dataclass(frozen=True)
class Fixup:
    """One file operation to do before launch. `kind` is one of:

    * `patch_train_batch_size`: set trainer_state.json `train_batch_size` to `value`, keeping the
      original as `backup` (only the first backup is kept, so repeating is harmless);
    * `archive_checkpoints`: move every `checkpoint-N` folder of `path` (the output dir) into
      `target`, so LLaMA-Factory cannot auto-resume from one; with `value` (a step), only those
      newer than that step (and no final weights);
    * `ds_to_universal`: run DeepSpeed's converter on `path`'s `ds_tag` into `target` and write
      `latest_universal` next to it;
    * `slim_universal_optimizer_state`: rewrite the universal checkpoint's `zero/optimizer_state.pt`
      (`path`) without the tensors the ZeRO-3 loader does not read, keeping the original as `backup`.
    """

    kind: str
    path: Path
    value: Any = None
    backup: Path | None = None
    target: Path | None = None

    def describe(self) -> str:
        if self.kind == "patch_train_batch_size":
            return f"set train_batch_size={self.value} in {self.path} (original kept as {self.backup})"
        if self.kind == "archive_checkpoints":
            if self.value is not None:
                return f"move the checkpoint-N of {self.path} newer than step {self.value} into {self.target}"
            return f"move every checkpoint-N of {self.path} into {self.target}"
        if self.kind == "ds_to_universal":
            return f"convert {self.path}/{self.value} to a universal checkpoint in {self.target}"
        if self.kind == "slim_universal_optimizer_state":
            return (f"slim {self.path} to what the ZeRO-3 universal loader reads (the step and the param groups), "
                    "so no rank loads the old rank 0's whole optimizer state")
        return f"{self.kind} {self.path}"


@dataclass(frozen=True)
class ResumePlan:
    """How the next attempt starts.

    `yaml`: keys to merge into the attempt's LLaMA-Factory YAML (always explicit: a checkpoint path
    or an explicit absence of one). `deepspeed`: keys to merge into its DeepSpeed JSON.
    `fixups`: file operations for `apply_fixups` before launch. `semantic_change`: set, in words,
    whenever the continued run is not the run the user asked for (the caller must record it as an
    event). `notes`: what the YAML renderer must respect (e.g. rotation).
    """

    mode: str  # "exact" | "universal" | "weights_only" | "fresh" | "restart"
    checkpoint: Checkpoint | None
    yaml: Mapping[str, Any]
    reason: str
    fixups: tuple[Fixup, ...] = ()
    semantic_change: str | None = None
    deepspeed: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    user_note: str | None = None  # how the job's own resume_from_checkpoint was read (judge.user_resume)


# Must hold for every plan: an explicit resume path (never auto-resume), and the output dir kept
# (`overwrite_output_dir: true` deletes trainer_log.jsonl).
RENDERER_NOTES = (
    "keep overwrite_output_dir false: true deletes trainer_log.jsonl (and steps/loss history)",
    (
        "save_total_limit is safe as set: rotation runs only after a successful save and the"
        " resume checkpoint is the newest complete one; quarantined/archived folders are outside"
        " the checkpoint-* glob"
    ),
)


# --------------------------------------------------------------------------- deciding (pure)


def run_shape(config: Mapping[str, Any], *, world_size: int, deepspeed_cfg: Mapping[str, Any] | None) -> RunShape:
    """The shape of a run from its LLaMA-Factory YAML and (already loaded) DeepSpeed JSON.

    Defaults are LLaMA-Factory's: micro-batch 8, accumulation 1, finetuning_type lora.
    """
    stage = off_opt = off_par = None
    universal = round_robin = False
    if deepspeed_cfg is not None:
        zero = deepspeed_cfg.get("zero_optimization") or {}
        stage = int(zero.get("stage", 0))
        off_opt = _offloaded(zero.get("offload_optimizer"))
        off_par = _offloaded(zero.get("offload_param"))
        section = deepspeed_cfg.get("checkpoint")
        universal = isinstance(section, Mapping) and bool(section.get("load_universal"))
        round_robin = isinstance(zero, Mapping) and bool(zero.get("round_robin_gradients"))
    return RunShape(
        deepspeed_stage=stage,
        offload_optimizer=bool(off_opt),
        offload_param=bool(off_par),
        world_size=world_size,
        micro_batch=int(config.get("per_device_train_batch_size", 8)),
        grad_accum=int(config.get("gradient_accumulation_steps", 1)),
        finetuning_type=str(config.get("finetuning_type", "lora")),
        load_universal=universal,
        round_robin=round_robin and stage in (1, 2),
    )


def _offloaded(section: Any) -> bool:
    return isinstance(section, Mapping) and str(section.get("device", "none")).lower() in ("cpu", "nvme")


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """Leading numeric parts of a version string ('5.2.0.dev0' -> (5, 2, 0)); None if unknown."""
    if not text:
        return None
    parts = []
    for piece in text.split("."):
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group()))
        if m.end() != len(piece):
            break
    return tuple(parts) or None


def plan_resume(
    ckpt: Checkpoint | None,
    *,
    prev: RunShape | None,
    nxt: RunShape,
    transformers_version: str | None,
    allow_weights_only: bool = False,
    allow_universal: bool = False,
    archive_name: str | None = None,
    output_dir: Path | None = None,
) -> ResumePlan:
    """Decide, before launch, how the next attempt (shape `nxt`) continues from `ckpt`.

    `prev` is the shape of the attempt that wrote the checkpoint when the supervisor knows it;
    what the checkpoint's files say (DeepSpeed or not, ZeRO layout, ranks) wins over it. The
    default never continues weights-only: that needs `allow_weights_only` and is always reported
    in `semantic_change`. `archive_name` names the folder (under .supervisor-archive/) that
    superseded checkpoints move to when the plan sets them aside; pass something unique per
    attempt (default: derived from the step). `output_dir` is the folder whose checkpoints are
    set aside (default: the checkpoint's own folder; it differs when the user named a checkpoint
    of another run).
    """
    if ckpt is None:
        return ResumePlan("fresh", None, {"resume_from_checkpoint": None, "overwrite_output_dir": False},
                          "no complete checkpoint: start from step 0", notes=RENDERER_NOTES)
    archive_name = archive_name or f"superseded-at-step-{ckpt.step}"
    out = output_dir or ckpt.path.parent
    if prev is not None and prev.finetuning_type != nxt.finetuning_type:
        return _restart(ckpt, out, f"finetuning_type changed ({prev.finetuning_type} -> {nxt.finetuning_type}):"
                        " the checkpoint's weights/adapter do not fit the new run", archive_name)
    if ckpt.adapter != (nxt.finetuning_type in _ADAPTER_METHODS) and ckpt.has_weights:
        return _restart(ckpt, out, f"checkpoint holds {'an adapter' if ckpt.adapter else 'full weights'}"
                        f" but the next run is finetuning_type={nxt.finetuning_type}", archive_name)

    src_stage = ckpt.zero_stage if ckpt.deepspeed else None
    src_world = ckpt.world_size or (prev.world_size if prev else None)
    dst_stage = nxt.deepspeed_stage

    why_not = _optimizer_state_incompatibility(ckpt, src_stage, src_world, prev, nxt)
    # Verified here for ZeRO-3 with a world-size change (2 ranks -> 1 -> 2, tests/checkpoints/
    # test_real_world_size.py). Stage changes via universal were not run: not offered.
    same_layout = src_stage in (2, 3) and dst_stage is not None and (src_stage == 3) == (dst_stage == 3)
    if why_not is None and nxt.load_universal and ckpt.deepspeed and same_layout:
        why_not = "the attempt loads ZeRO checkpoints through DeepSpeed's universal format (per parameter)"
    elif why_not is None:
        return _exact(ckpt, prev, nxt, transformers_version)

    scrambled = _round_robin_trap(src_stage, src_world, prev, nxt)
    if (allow_universal and ckpt.deepspeed and same_layout and not scrambled
            and (src_world != nxt.world_size or nxt.load_universal)):
        tag = ckpt.ds_tag or f"global_step{ckpt.step}"
        target = ckpt.path / f"{tag}_universal"
        fixups = [Fixup("ds_to_universal", ckpt.path, value=tag, target=target)]
        keys: dict[str, Any] = {"checkpoint": {"load_universal": True}}
        reason = f"{why_not}; converting to a DeepSpeed universal checkpoint keeps optimizer state"
        if dst_stage in (1, 2) and nxt.world_size > 1:
            keys["zero_optimization"] = {"round_robin_gradients": False}  # else the load is silently wrong
            reason += " (round_robin_gradients off: the universal mapping assumes the natural order)"
        if nxt.lean_load and dst_stage == 3:
            state = target / "zero" / "optimizer_state.pt"
            fixups.append(Fixup("slim_universal_optimizer_state", state,
                                backup=state.with_name("optimizer_state.pt.supervisor-orig")))
            reason += "; loaded lean: no rank holds the old rank 0's whole optimizer file"
        return ResumePlan(
            "universal", ckpt,
            {"resume_from_checkpoint": str(ckpt.path), "overwrite_output_dir": False},
            reason=reason, fixups=tuple(fixups), deepspeed=keys,
            notes=RENDERER_NOTES + ("merge `deepspeed` into the attempt's DeepSpeed JSON",),
        )
    if scrambled:
        why_not += f"; {scrambled}"
    if allow_weights_only:
        return _weights_only(ckpt, out, nxt, why_not, archive_name)
    return _restart(ckpt, out, f"{why_not}; weights-only continuation not allowed by policy", archive_name)


def _round_robin_trap(src_stage: int | None, src_world: int | None, prev: RunShape | None,
                      nxt: RunShape) -> str | None:
    """Measured (DeepSpeed 0.19.8): a ZeRO-1/2 checkpoint written with `round_robin_gradients: true`
    (LLaMA-Factory's ds_z2 preset) on more than one rank converts to universal with scrambled fp32
    weights, silently: the flat buffer is in round-robin order, the mapping assumes the natural one."""
    if src_stage != 2 or not src_world or src_world < 2:
        return None
    was = prev.round_robin if prev is not None else nxt.round_robin
    if not was:
        return None
    return (f"its {src_world}-rank ZeRO-2 shards were written with round_robin_gradients: DeepSpeed's "
            "universal conversion of them is silently wrong, so it is not used")


def _optimizer_state_incompatibility(
    ckpt: Checkpoint, src_stage: int | None, src_world: int | None, prev: RunShape | None,
    nxt: RunShape,
) -> str | None:
    """Why the checkpoint's optimizer state cannot be loaded by the next run, or None."""
    dst_stage = nxt.deepspeed_stage
    if not ckpt.has_optimizer:
        return f"{ckpt.path.name} has no optimizer state (save_only_model?)"
    if src_stage is None and dst_stage is not None:
        return "no DeepSpeed -> DeepSpeed: transformers finds no global_step folder to load"
    if src_stage is not None and dst_stage is None:
        return ("DeepSpeed -> no DeepSpeed: transformers would load the weights but silently restart"
                " optimizer and LR schedule")
    if src_stage is not None and dst_stage is not None:
        if (src_stage == 3) != (dst_stage == 3):
            return f"ZeRO-{src_stage} layout -> ZeRO-{dst_stage}: partitioned optimizer state differs"
        if src_stage == 0 and dst_stage != 0:
            return f"DeepSpeed without ZeRO -> ZeRO-{dst_stage}"
        if src_world is not None and src_world != nxt.world_size:
            return f"world size {src_world} -> {nxt.world_size}: ZeRO shards are per rank"
        if prev is not None and not prev.offload_optimizer and nxt.offload_optimizer:
            # Observed (DeepSpeed 0.19.8, transformers 5.6): the state loads, then the first
            # step dies in DeepSpeedCPUAdam with KeyError: 'bias_correction' (torch AdamW's
            # param_groups lack it). Offload ON -> OFF resumes exactly.
            return ("turning ZeRO optimizer offload on: the saved torch-AdamW state does not fit"
                    " DeepSpeedCPUAdam (KeyError 'bias_correction' at the first step)")
    return None


def _exact(ckpt: Checkpoint, prev: RunShape | None, nxt: RunShape, tf_version: str | None) -> ResumePlan:
    fixups: list[Fixup] = []
    notes = list(RENDERER_NOTES)
    semantic = None
    reason = f"resume {ckpt.path.name} exactly (optimizer, LR schedule, data position, RNG)"
    if prev is not None and prev.effective_batch != nxt.effective_batch:
        semantic = (f"effective batch changes {prev.effective_batch} -> {nxt.effective_batch}:"
                    " the data position and LR schedule after step"
                    f" {ckpt.step} no longer match the original run")
    if ckpt.world_size and ckpt.world_size != nxt.world_size and not ckpt.deepspeed:
        # Measured 2 -> 1 (losses within 1e-6, lr identical): transformers looks for rng_state.pth on
        # one rank and rng_state_<rank>.pth on several, so a layout change finds none.
        reason += (f"; world size {ckpt.world_size} -> {nxt.world_size}: the weights, the optimizer state "
                   "(one optimizer.pt, per parameter, not per rank), the LR schedule, the step and the data "
                   "position carry over (the effective batch is kept); the RNG state does not (no RNG file of "
                   "the new layout: harmless without dropout)")
    old_tbs = ckpt.train_batch_size
    if old_tbs is not None and old_tbs != nxt.micro_batch:
        version = parse_version(tf_version)
        if version is None or version < BATCH_SIZE_RESTORE_FIXED_IN:
            fixups.append(Fixup(
                "patch_train_batch_size", ckpt.path / TRAINER_STATE, value=nxt.micro_batch,
                backup=ckpt.path / TRAINER_STATE_BACKUP,
            ))
            reason += (f"; transformers {tf_version or '(unknown version)'} would restore the old"
                       f" micro-batch {old_tbs} from trainer_state.json: patch it to {nxt.micro_batch}")
        else:
            reason += f"; micro-batch {old_tbs} -> {nxt.micro_batch} (transformers {tf_version} honours it)"
    return ResumePlan(
        "exact", ckpt,
        {"resume_from_checkpoint": str(ckpt.path), "overwrite_output_dir": False},
        reason=reason, fixups=tuple(fixups), semantic_change=semantic, notes=tuple(notes),
    )


def _weights_only(ckpt: Checkpoint, out: Path, nxt: RunShape, why_not: str, archive_name: str) -> ResumePlan:
    if nxt.deepspeed_stage is None and ckpt.deepspeed and ckpt.has_weights:
        # transformers itself does this when a DeepSpeed checkpoint meets a non-DeepSpeed run:
        # weights, global step, data position and RNG continue; optimizer and LR schedule restart.
        return ResumePlan(
            "weights_only", ckpt,
            {"resume_from_checkpoint": str(ckpt.path), "overwrite_output_dir": False},
            reason=why_not,
            semantic_change=(f"WEIGHTS-ONLY continuation from {ckpt.path.name}: step counter and data"
                             f" position continue at {ckpt.step}, but the optimizer state (Adam"
                             " moments) is discarded and the LR schedule restarts from its first"
                             " step (warm-up again)"),
            notes=RENDERER_NOTES,
        )
    if not ckpt.has_weights:
        return _restart(ckpt, out, f"{why_not}; and {ckpt.path.name} has no consolidated weights"
                        " (ZeRO-3 without stage3_gather_16bit_weights_on_model_save)", archive_name)
    archive = _archive(out, archive_name)
    moved = archive.target / ckpt.path.name if ckpt.path.parent == out else ckpt.path
    key = "adapter_name_or_path" if ckpt.adapter else "model_name_or_path"
    return ResumePlan(
        "weights_only", ckpt,
        {key: str(moved), "resume_from_checkpoint": None, "overwrite_output_dir": False},
        reason=why_not,
        fixups=(archive,),
        semantic_change=(f"WEIGHTS-ONLY continuation from {ckpt.path.name}: a new run starts from"
                         f" its {'adapter' if ckpt.adapter else 'weights'}; optimizer state, LR"
                         " schedule, step counter and data order all restart from zero, so the"
                         f" first {ckpt.step} steps' data is seen again"),
        notes=RENDERER_NOTES + (
            (
                f"checkpoints are archived under {archive.target} so LLaMA-Factory cannot"
                " auto-resume from them; the weights are read from there"
            ),
        ),
    )


def _restart(ckpt: Checkpoint, out: Path, reason: str, archive_name: str) -> ResumePlan:
    archive = _archive(out, archive_name)
    return ResumePlan(
        "restart", ckpt, {"resume_from_checkpoint": None, "overwrite_output_dir": False},
        reason=reason + f"; checkpoints are archived under {archive.target}, not deleted",
        fixups=(archive,),
        semantic_change=f"training restarts from step 0; progress up to step {ckpt.step} is set aside",
        notes=RENDERER_NOTES,
    )


def _archive(out: Path, archive_name: str) -> Fixup:
    """Move every `checkpoint-N` of the output dir out of LLaMA-Factory's sight.

    Without it LLaMA-Factory auto-resumes from the highest one (resume_from_checkpoint unset).
    """
    return Fixup("archive_checkpoints", out, target=out / ARCHIVE_DIR / archive_name)


# --------------------------------------------------------------------------- retention


@dataclass(frozen=True)
class Aside:
    """A folder the supervisor moved aside: a quarantined checkpoint or an archive of them."""

    path: Path
    kind: str  # "quarantined" | "archived"
    mtime: float
    complete_steps: tuple[int, ...] = ()  # complete checkpoints inside (archives)
    size_bytes: int = 0


@dataclass(frozen=True)
class Removal:
    aside: Aside
    why: str

    def describe(self) -> str:
        return f"removed {self.aside.kind} {self.aside.path} ({self.aside.size_bytes / (1 << 30):.2f} GiB): {self.why}"


def plan_retention(asides: Sequence[Aside], *, live_complete: int, keep_quarantined: int,
                   keep_archived: int) -> list[Removal]:
    """Which set-aside folders to reclaim: all but the newest `keep_*` of each kind, never the
    archive that holds the only complete checkpoint left (when output_dir has none of its own).
    Pure: the caller removes them (`reclaim`) and records what was removed."""
    out: list[Removal] = []
    by_age = sorted(asides, key=lambda a: a.mtime, reverse=True)
    quarantined = [a for a in by_age if a.kind == "quarantined"]
    archived = [a for a in by_age if a.kind == "archived"]
    for a in quarantined[keep_quarantined:]:
        out.append(Removal(a, f"incomplete, and older than the {keep_quarantined} newest quarantined kept"))
    protected = None
    if live_complete == 0:
        protected = next((a for a in archived if a.complete_steps), None)
    for a in archived[keep_archived:]:
        if a is protected:
            continue
        out.append(Removal(a, f"superseded, and older than the {keep_archived} newest archives kept"))
    return out
