"""Which checkpoint the next attempt resumes from, and how.

Three layers, kept apart on purpose:

* reading (`scan_output_dir`): look at `checkpoint-N/` folders and decide which are COMPLETE,
  from file names and trainer_state.json only (no torch). We never rely on LLaMA-Factory's
  auto-resume: it takes the highest `checkpoint-N` with no completeness check, and a crash during
  a save leaves exactly such a folder (resuming it dies with FileNotFoundError).
* deciding (`run_shape`, `plan_resume`): pure functions. A plan says how the next attempt resumes
  (`exact`, `universal`, `weights_only`, `fresh`, `restart`), which YAML keys it needs, which file
  fixes must happen first, and, in words, whether training semantics change.
* acting (`quarantine`, `apply_fixups`): renames and small atomic file edits. Nothing is ever
  deleted: incomplete or superseded checkpoints are moved under hidden folders that neither
  transformers' rotation glob (`checkpoint-*`) nor its last-checkpoint regex
  (`^checkpoint-\\d+$`) can see, so `save_total_limit` rotation can never remove them and
  auto-resume can never pick them.

Compatibility rules. [run] = measured here through LLaMA-Factory 0.9.5, transformers 5.6,
DeepSpeed 0.19.8 on the CPU; [read] = from upstream source only.
* same shape: exact resume; losses bit-identical to an uninterrupted run [run].
* micro-batch x grad-accum changed, product (x world size) kept: exact on transformers >= 5.2
  (LR identical, losses within 1e-4) [run]; older transformers read the checkpoint's
  `train_batch_size` back, so the smaller micro-batch would silently not apply: the plan
  patches trainer_state.json after backing it up [read; the patch itself is run on real files].
* ZeRO-3, same world size: optimizer offload ON -> OFF and param offload either way resume
  exactly [run]; optimizer offload OFF -> ON loads, then the first step dies in DeepSpeedCPUAdam
  with KeyError 'bias_correction' [run]: incompatible when the previous shape is known.
* no DeepSpeed -> ZeRO-3: `Can't find a valid checkpoint` [run]. ZeRO-3 -> ZeRO-2:
  AssertionError [run]. ZeRO-3 -> no DeepSpeed: weights and step continue, optimizer and LR
  schedule silently restart (LR 0.0 at the next step) [run].
* ZeRO-3 on 2 ranks -> 1: ZeRORuntimeException [run]; after ds_to_universal + load_universal
  it resumes with the LR schedule continuing and losses matching [run]. Universal is offered
  only for such world-size changes within the same ZeRO layout (stage changes not run).
* otherwise `weights_only` when the policy allows (recorded loudly), else `restart`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")  # transformers' own `_re_checkpoint`
TRAINER_STATE = "trainer_state.json"
QUARANTINE_DIR = ".supervisor-quarantine"  # hidden, and not matched by `checkpoint-*`
ARCHIVE_DIR = ".supervisor-archive"
TRAINER_STATE_BACKUP = "trainer_state.json.supervisor-orig"

# transformers >= 5.2 no longer restores the checkpoint's per-device batch size on resume
# (huggingface/transformers#43708); before that, `Trainer.train` does
# `self._train_batch_size = state.train_batch_size` whenever trainer_state.json has it.
BATCH_SIZE_RESTORE_FIXED_IN = (5, 2)

_ADAPTER_METHODS = ("lora", "oft")  # LLaMA-Factory methods that save a PEFT adapter
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# LLaMA-Factory's CHECKPOINT_NAMES (+ the shards an index names): final weights in output_dir.
_FINAL_WEIGHTS_RE = re.compile(
    r"^(?:adapter_model\.(?:safetensors|bin)|model\.safetensors(?:\.index\.json)?"
    r"|pytorch_model\.bin(?:\.index\.json)?|model-\d+-of-\d+\.safetensors"
    r"|pytorch_model-\d+-of-\d+\.bin)$"
)
_RNG_RANK_RE = re.compile(r"^rng_state_(\d+)\.pth$")
_OPTIM_SHARD_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_ZERO3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MP_MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
# FSDP, as accelerate's save_fsdp_model / save_fsdp_optimizer write it into checkpoint-N
# (FSDP_MODEL_NAME = "pytorch_model_fsdp", OPTIMIZER_NAME = "optimizer"):
#   SHARDED_STATE_DICT: pytorch_model_fsdp_<i>/ and optimizer_<i>/, each a
#     torch.distributed.checkpoint folder: __<rank>_<n>.distcp files + `.metadata`, which the
#     coordinator writes after every rank's data (finish()), so `.metadata` marks a finished save;
#   FULL_STATE_DICT: pytorch_model_fsdp.bin (+ _<i>.bin) and optimizer.bin, from rank 0;
#   LOCAL_STATE_DICT: pytorch_model_fsdp_rank<r>.bin per rank.
_FSDP_SHARDED_DIR_RE = re.compile(r"^pytorch_model_fsdp_(\d+)$")
_FSDP_OPTIM_DIR_RE = re.compile(r"^optimizer_(\d+)$")
_FSDP_FULL_RE = re.compile(r"^pytorch_model_fsdp(?:_\d+)?\.bin$")
_FSDP_LOCAL_RE = re.compile(r"^pytorch_model_fsdp(?:_\d+)?_rank(\d+)\.bin$")
_DISTCP_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
DCP_METADATA = ".metadata"


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

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size


@dataclass(frozen=True)
class Fixup:
    """One file operation to do before launch. `kind` is one of:

    * `patch_train_batch_size`: set trainer_state.json `train_batch_size` to `value`, keeping the
      original as `backup` (only the first backup is kept, so repeating is harmless);
    * `archive_checkpoints`: move every `checkpoint-N` folder of `path` (the output dir) into
      `target`, so LLaMA-Factory cannot auto-resume from one;
    * `ds_to_universal`: run DeepSpeed's converter on `path`'s `ds_tag` into `target` and write
      `latest_universal` next to it.
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
            return f"move every checkpoint-N of {self.path} into {self.target}"
        if self.kind == "ds_to_universal":
            return f"convert {self.path}/{self.value} to a universal checkpoint in {self.target}"
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


# --------------------------------------------------------------------------- reading (I/O)


def scan_output_dir(output_dir: Path, *, expected_world_size: int | None = None) -> Scan:
    """Classify every `checkpoint-N` folder of `output_dir`. Read-only.

    Call it between attempts (a save in progress looks incomplete). `expected_world_size`, when
    the supervisor knows how many ranks wrote the checkpoints, makes the per-rank checks strict;
    without it the ranks present must at least be consistent (0..k-1 for every kind of file).
    """
    output_dir = Path(output_dir)
    complete: list[Checkpoint] = []
    incomplete: list[Incomplete] = []
    try:
        entries = sorted(os.scandir(output_dir), key=lambda e: e.name)
    except FileNotFoundError:
        return Scan((), ())
    for entry in entries:
        m = CHECKPOINT_RE.match(entry.name)
        if not m or not entry.is_dir():
            continue
        result = inspect_checkpoint(Path(entry.path), int(m.group(1)), expected_world_size)
        (complete if isinstance(result, Checkpoint) else incomplete).append(result)
    complete.sort(key=lambda c: c.step)
    incomplete.sort(key=lambda i: i.step or -1)
    return Scan(tuple(complete), tuple(incomplete))


def inspect_checkpoint(
    path: Path, step: int, expected_world_size: int | None = None
) -> Checkpoint | Incomplete:
    """Decide whether one checkpoint folder is complete (see `scan_output_dir`)."""
    try:
        names = set(os.listdir(path))
    except OSError as e:
        return Incomplete(path, step, f"unreadable folder: {e}")
    if TRAINER_STATE not in names:
        return Incomplete(path, step, f"no {TRAINER_STATE} (written last: the save did not finish)")
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
    except (OSError, ValueError) as e:
        return Incomplete(path, step, f"{TRAINER_STATE} unreadable: {e}")
    if not isinstance(state, dict):
        return Incomplete(path, step, f"{TRAINER_STATE} is not a JSON object")
    if state.get("global_step") != step:
        return Incomplete(path, step, f"{TRAINER_STATE} says global_step {state.get('global_step')}")

    rng_ranks = _ranks(names, _RNG_RANK_RE)
    if "rng_state.pth" in names:
        rng_ranks.add(0)
    adapter = any(n in names for n in _ADAPTER_FILES)
    weights_missing = _missing_weight_shards(path, names)
    has_weights = adapter or (weights_missing == [] and _has_any(names, _WEIGHT_FILES + _WEIGHT_INDEXES))
    if weights_missing:
        return Incomplete(path, step, f"weight shards missing: {', '.join(weights_missing)}")

    deepspeed = "latest" in names or any(n.startswith("global_step") for n in names)
    ds_tag = zero_stage = None
    fsdp = _inspect_fsdp(path, names)
    if isinstance(fsdp, str):
        return Incomplete(path, step, fsdp)
    if fsdp is not None and not deepspeed:
        kind, fsdp_ranks, fsdp_optim = fsdp
        world = _world_from(rng_ranks | fsdp_ranks)
        if fsdp_ranks and fsdp_ranks != set(range(world)):
            return Incomplete(path, step, f"FSDP shards missing for ranks {_gaps(fsdp_ranks, world)}")
        if expected_world_size is not None:
            world = max(world, expected_world_size)
        if world and rng_ranks != set(range(world)):
            return Incomplete(path, step, f"RNG state missing for ranks {_gaps(rng_ranks, world)}")
        if fsdp_optim and "scheduler.pt" not in names:
            return Incomplete(path, step, "FSDP optimizer state without scheduler.pt")
        tbs = state.get("train_batch_size")
        return Checkpoint(
            path=path, step=step, deepspeed=False, zero_stage=None, world_size=world or None,
            train_batch_size=tbs if isinstance(tbs, int) else None,
            has_weights=has_weights, adapter=adapter, has_optimizer=fsdp_optim, fsdp=kind,
            max_steps=state.get("max_steps") if isinstance(state.get("max_steps"), int) else None,
        )
    if deepspeed:
        ds = _inspect_deepspeed(path, names)
        if isinstance(ds, str):
            return Incomplete(path, step, ds)
        ds_tag, zero_stage, shard_ranks = ds
        world = _world_from(rng_ranks | shard_ranks)
        if shard_ranks and shard_ranks != set(range(world)):
            return Incomplete(path, step, f"DeepSpeed shards missing for ranks {_gaps(shard_ranks, world)}")
        has_optimizer = True
    else:
        world = _world_from(rng_ranks)
        has_optimizer = "optimizer.pt" in names or "optimizer.bin" in names
        if has_optimizer and "scheduler.pt" not in names:
            return Incomplete(path, step, "optimizer.pt without scheduler.pt")
        if not has_weights:
            return Incomplete(path, step, "no model weights or adapter")
    if expected_world_size is not None:
        world = max(world or 0, expected_world_size)
    if world and rng_ranks and rng_ranks != set(range(world)):
        # Every rank writes its own RNG state; rank 0 may write trainer_state.json first.
        return Incomplete(path, step, f"RNG state missing for ranks {_gaps(rng_ranks, world)}")
    if expected_world_size and deepspeed and zero_stage and shard_ranks != set(range(world)):
        return Incomplete(path, step, f"DeepSpeed shards missing for ranks {_gaps(shard_ranks, world)}")
    if has_optimizer and not rng_ranks and not deepspeed:
        return Incomplete(path, step, "no rng_state*.pth")

    tbs = state.get("train_batch_size")
    return Checkpoint(
        path=path,
        step=step,
        deepspeed=deepspeed,
        zero_stage=zero_stage,
        world_size=world or None,
        train_batch_size=tbs if isinstance(tbs, int) else None,
        has_weights=has_weights,
        adapter=adapter,
        has_optimizer=has_optimizer,
        ds_tag=ds_tag,
        max_steps=state.get("max_steps") if isinstance(state.get("max_steps"), int) else None,
    )


def _inspect_fsdp(path: Path, names: set[str]) -> tuple[str, set[int], bool] | str | None:
    """(state-dict type, ranks whose model shards are present, has optimizer state), None when
    the folder holds no FSDP state, or why the FSDP part is incomplete."""
    sharded = sorted(n for n in names if _FSDP_SHARDED_DIR_RE.match(n) and (path / n).is_dir())
    optim_dirs = sorted(n for n in names if _FSDP_OPTIM_DIR_RE.match(n) and (path / n).is_dir())
    if sharded:
        ranks: set[int] | None = None
        for d in (*sharded, *optim_dirs):
            try:
                files = set(os.listdir(path / d))
            except OSError as e:
                return f"FSDP folder {d} unreadable: {e}"
            if DCP_METADATA not in files:
                return (f"FSDP sharded state {d}/ has no {DCP_METADATA} "
                        "(written last: the save did not finish)")
            here = _ranks(files, _DISTCP_RE)
            if not here:
                return f"FSDP sharded state {d}/ has no .distcp files"
            if ranks is not None and here != ranks:
                return (f"FSDP shards disagree: {d}/ has ranks {sorted(here)}, "
                        f"{sharded[0]}/ has {sorted(ranks)}")
            ranks = here if ranks is None else ranks
        return "sharded", ranks or set(), bool(optim_dirs)
    local = _ranks(names, _FSDP_LOCAL_RE)
    if local:
        return "local", local, "optimizer.bin" in names
    if any(_FSDP_FULL_RE.match(n) for n in names):
        return "full", set(), "optimizer.bin" in names
    return None


def _inspect_deepspeed(path: Path, names: set[str]) -> tuple[str, int, set[int]] | str:
    """(tag, zero stage, ranks with optimizer shards) or the reason the DS part is incomplete."""
    if "latest" not in names:
        return "DeepSpeed global_step folder without `latest` (save did not finish)"
    try:
        tag = (path / "latest").read_text().strip()
    except OSError as e:
        return f"DeepSpeed `latest` unreadable: {e}"
    tag_dir = path / tag
    if not tag or "/" in tag or not tag_dir.is_dir():
        return f"DeepSpeed `latest` names {tag!r}, which does not exist"
    files = set(os.listdir(tag_dir))
    optim = _ranks(files, _OPTIM_SHARD_RE)
    zero3_models = _ranks(files, _ZERO3_MODEL_RE)
    if zero3_models:
        if optim != zero3_models:
            return f"ZeRO-3 shards disagree in {tag}: model ranks {sorted(zero3_models)}, optimizer ranks {sorted(optim)}"
        return tag, 3, optim
    if not _ranks(files, _MP_MODEL_RE):
        return f"no model states in {tag}"
    return tag, (2 if optim else 0), optim


def _ranks(names: set[str], pattern: re.Pattern[str]) -> set[int]:
    return {int(m.group(1)) for n in names if (m := pattern.match(n))}


def _world_from(ranks: set[int]) -> int:
    return max(ranks) + 1 if ranks else 0


def _gaps(present: set[int], world: int) -> list[int]:
    return sorted(set(range(world)) - present)


def _has_any(names: set[str], wanted: Sequence[str]) -> bool:
    return any(n in names for n in wanted)


def _missing_weight_shards(path: Path, names: set[str]) -> list[str]:
    for index in _WEIGHT_INDEXES:
        if index in names:
            try:
                shards = set(json.loads((path / index).read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return [f"{index} (unreadable)"]
            return sorted(s for s in shards if s not in names)
    return []


# --------------------------------------------------------------------------- acting (I/O)


def quarantine(inc: Incomplete, *, now: float | None = None) -> Path:
    """Move an incomplete checkpoint aside (never delete it) and return where it went.

    Target: `<output_dir>/.supervisor-quarantine/checkpoint-N.incomplete-<UTC time>`: out of
    transformers' `checkpoint-*` rotation glob and last-checkpoint regex, on the same filesystem.
    """
    return _move_aside(inc.path, QUARANTINE_DIR, "incomplete", now)


def _move_aside(path: Path, folder: str, label: str, now: float | None) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    dest_dir = path.parent / folder
    dest_dir.mkdir(exist_ok=True)
    dest = dest_dir / f"{path.name}.{label}-{stamp}"
    n = 1
    while dest.exists():
        n += 1
        dest = dest_dir / f"{path.name}.{label}-{stamp}.{n}"
    os.rename(path, dest)
    return dest


def apply_fixups(plan: ResumePlan, *, python: str | None = None) -> list[str]:
    """Do the plan's file operations; return what was done, in words.

    `python` runs the DeepSpeed converter (the job's interpreter; defaults to this one).
    Raises on failure: launching after a half-applied fixup would resume the wrong state.
    """
    done: list[str] = []
    for fx in plan.fixups:
        if fx.kind == "patch_train_batch_size":
            done.append(_patch_train_batch_size(fx))
        elif fx.kind == "archive_checkpoints":
            done.extend(_archive_checkpoints(fx))
        elif fx.kind == "ds_to_universal":
            done.append(_ds_to_universal(fx, python or sys.executable))
        else:
            raise ValueError(f"unknown fixup kind {fx.kind!r}")
    return done


def _archive_checkpoints(fx: Fixup) -> list[str]:
    """Move checkpoint-N folders, and final weights in the output dir itself, into fx.target.

    Final weights too: with them and no checkpoint, LLaMA-Factory refuses to start ("Output
    directory already exists and is not empty").
    """
    assert fx.target is not None
    entries = os.listdir(fx.path)
    names = sorted(n for n in entries if CHECKPOINT_RE.match(n) and (fx.path / n).is_dir())
    finals = sorted(n for n in entries if _FINAL_WEIGHTS_RE.match(n) and (fx.path / n).is_file())
    if names and fx.target.exists() and any((fx.target / n).exists() for n in names):
        raise FileExistsError(f"{fx.target} already holds {names}: refusing to merge archives")
    fx.target.mkdir(parents=True, exist_ok=True)
    for n in names:
        os.rename(fx.path / n, fx.target / n)
    if finals:
        (fx.target / "final-weights").mkdir(exist_ok=True)
        for n in finals:
            os.rename(fx.path / n, fx.target / "final-weights" / n)
    return [f"moved {n} to {fx.target}" for n in names] + (
        [f"moved final weights ({', '.join(finals)}) to {fx.target / 'final-weights'}"] if finals else []
    )


def _patch_train_batch_size(fx: Fixup) -> str:
    state_path = fx.path
    assert fx.backup is not None
    if not fx.backup.exists():
        shutil.copy2(state_path, fx.backup)
    state = json.loads(state_path.read_text())
    old = state.get("train_batch_size")
    if old == fx.value:
        return f"train_batch_size already {fx.value} in {state_path}"
    state["train_batch_size"] = fx.value
    _atomic_write(state_path, json.dumps(state, indent=2, sort_keys=True) + "\n")
    return f"set train_batch_size {old} -> {fx.value} in {state_path} (original in {fx.backup.name})"


def _ds_to_universal(fx: Fixup, python: str) -> str:
    assert fx.target is not None
    if not fx.target.is_dir():
        tmp = fx.target.with_name(fx.target.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)  # our own leftover from an interrupted conversion
        subprocess.run(
            [python, "-m", "deepspeed.checkpoint.ds_to_universal",
             "--input_folder", str(fx.path / fx.value), "--output_folder", str(tmp)],
            check=True, capture_output=True, text=True,
        )
        os.rename(tmp, fx.target)
    _atomic_write(fx.path / "latest_universal", fx.target.name)
    return fx.describe()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --------------------------------------------------------------------------- deciding (pure)


def run_shape(config: Mapping[str, Any], *, world_size: int, deepspeed_cfg: Mapping[str, Any] | None) -> RunShape:
    """The shape of a run from its LLaMA-Factory YAML and (already loaded) DeepSpeed JSON.

    Defaults are LLaMA-Factory's: micro-batch 8, accumulation 1, finetuning_type lora.
    """
    stage = off_opt = off_par = None
    if deepspeed_cfg is not None:
        zero = deepspeed_cfg.get("zero_optimization") or {}
        stage = int(zero.get("stage", 0))
        off_opt = _offloaded(zero.get("offload_optimizer"))
        off_par = _offloaded(zero.get("offload_param"))
    return RunShape(
        deepspeed_stage=stage,
        offload_optimizer=bool(off_opt),
        offload_param=bool(off_par),
        world_size=world_size,
        micro_batch=int(config.get("per_device_train_batch_size", 8)),
        grad_accum=int(config.get("gradient_accumulation_steps", 1)),
        finetuning_type=str(config.get("finetuning_type", "lora")),
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
) -> ResumePlan:
    """Decide, before launch, how the next attempt (shape `nxt`) continues from `ckpt`.

    `prev` is the shape of the attempt that wrote the checkpoint when the supervisor knows it;
    what the checkpoint's files say (DeepSpeed or not, ZeRO layout, ranks) wins over it. The
    default never continues weights-only: that needs `allow_weights_only` and is always reported
    in `semantic_change`. `archive_name` names the folder (under .supervisor-archive/) that
    superseded checkpoints move to when the plan sets them aside; pass something unique per
    attempt (default: derived from the step).
    """
    if ckpt is None:
        return ResumePlan("fresh", None, {"resume_from_checkpoint": None, "overwrite_output_dir": False},
                          "no complete checkpoint: start from step 0", notes=RENDERER_NOTES)
    archive_name = archive_name or f"superseded-at-step-{ckpt.step}"
    if prev is not None and prev.finetuning_type != nxt.finetuning_type:
        return _restart(ckpt, f"finetuning_type changed ({prev.finetuning_type} -> {nxt.finetuning_type}):"
                        " the checkpoint's weights/adapter do not fit the new run", archive_name)
    if ckpt.adapter != (nxt.finetuning_type in _ADAPTER_METHODS) and ckpt.has_weights:
        return _restart(ckpt, f"checkpoint holds {'an adapter' if ckpt.adapter else 'full weights'}"
                        f" but the next run is finetuning_type={nxt.finetuning_type}", archive_name)

    src_stage = ckpt.zero_stage if ckpt.deepspeed else None
    src_world = ckpt.world_size or (prev.world_size if prev else None)
    dst_stage = nxt.deepspeed_stage

    why_not = _optimizer_state_incompatibility(ckpt, src_stage, src_world, prev, nxt)
    if why_not is None:
        return _exact(ckpt, prev, nxt, transformers_version)

    # Verified here for ZeRO-3 with a world-size change (2 ranks -> 1: converted in 2 s, resumed
    # with the LR schedule continuing). Stage changes via universal were not run: not offered.
    same_layout = src_stage in (2, 3) and dst_stage is not None and (src_stage == 3) == (dst_stage == 3)
    if allow_universal and ckpt.deepspeed and same_layout and src_world != nxt.world_size:
        tag = ckpt.ds_tag or f"global_step{ckpt.step}"
        target = ckpt.path / f"{tag}_universal"
        return ResumePlan(
            "universal", ckpt,
            {"resume_from_checkpoint": str(ckpt.path), "overwrite_output_dir": False},
            reason=f"{why_not}; converting to a DeepSpeed universal checkpoint keeps optimizer state",
            fixups=(Fixup("ds_to_universal", ckpt.path, value=tag, target=target),),
            deepspeed={"checkpoint": {"load_universal": True}},
            notes=RENDERER_NOTES + ("merge `deepspeed` into the attempt's DeepSpeed JSON",),
        )
    if allow_weights_only:
        return _weights_only(ckpt, nxt, why_not, archive_name)
    return _restart(ckpt, f"{why_not}; weights-only continuation not allowed by policy", archive_name)


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


def _weights_only(ckpt: Checkpoint, nxt: RunShape, why_not: str, archive_name: str) -> ResumePlan:
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
        return _restart(ckpt, f"{why_not}; and {ckpt.path.name} has no consolidated weights"
                        " (ZeRO-3 without stage3_gather_16bit_weights_on_model_save)", archive_name)
    archive = _archive(ckpt, archive_name)
    moved = archive.target / ckpt.path.name
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


def _restart(ckpt: Checkpoint, reason: str, archive_name: str) -> ResumePlan:
    archive = _archive(ckpt, archive_name)
    return ResumePlan(
        "restart", ckpt, {"resume_from_checkpoint": None, "overwrite_output_dir": False},
        reason=reason + f"; checkpoints are archived under {archive.target}, not deleted",
        fixups=(archive,),
        semantic_change=f"training restarts from step 0; progress up to step {ckpt.step} is set aside",
        notes=RENDERER_NOTES,
    )


def _archive(ckpt: Checkpoint, archive_name: str) -> Fixup:
    """Move every `checkpoint-N` of the output dir out of LLaMA-Factory's sight.

    Without it LLaMA-Factory auto-resumes from the highest one (resume_from_checkpoint unset).
    """
    out = ckpt.path.parent
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


def _tree_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def list_asides(output_dir: Path) -> list[Aside]:
    """Edge: the quarantined and archived folders of `output_dir`, with what they hold."""
    out: list[Aside] = []
    for folder, kind in ((QUARANTINE_DIR, "quarantined"), (ARCHIVE_DIR, "archived")):
        base = Path(output_dir) / folder
        try:
            entries = sorted(os.scandir(base), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            if not e.is_dir(follow_symlinks=False):
                continue
            steps: tuple[int, ...] = ()
            if kind == "archived":
                steps = tuple(c.step for c in scan_output_dir(Path(e.path)).complete)
            out.append(Aside(Path(e.path), kind, e.stat(follow_symlinks=False).st_mtime, steps,
                             _tree_size(Path(e.path))))
    return out


def reclaim(output_dir: Path, *, keep_quarantined: int, keep_archived: int) -> list[Removal]:
    """Edge: apply the retention rule to `output_dir`; return what was removed (to record)."""
    live = len(scan_output_dir(Path(output_dir)).complete)
    removals = plan_retention(list_asides(Path(output_dir)), live_complete=live,
                              keep_quarantined=keep_quarantined, keep_archived=keep_archived)
    for r in removals:
        shutil.rmtree(r.aside.path)
    return removals
