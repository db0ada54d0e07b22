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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from supervisor.judge.resume import (
    ARCHIVE_DIR,
    TRAINER_STATE,
    Aside,
    Checkpoint,
    Fixup,
    Incomplete,
    Removal,
    ResumePlan,
    Scan,
    plan_retention,
)

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")  # transformers' own `_re_checkpoint`
QUARANTINE_DIR = ".supervisor-quarantine"  # hidden, and not matched by `checkpoint-*`

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
    state = _read_trainer_state(path, step, names)
    if isinstance(state, Incomplete):
        return state
    rng_ranks = _ranks(names, _RNG_RANK_RE)
    if "rng_state.pth" in names:
        rng_ranks.add(0)
    adapter = any(n in names for n in _ADAPTER_FILES)
    weights_missing = _missing_weight_shards(path, names)
    has_weights = adapter or (weights_missing == [] and _has_any(names, _WEIGHT_FILES + _WEIGHT_INDEXES))
    if weights_missing:
        return Incomplete(path, step, f"weight shards missing: {', '.join(weights_missing)}")
    seen = _Seen(path, step, names, state, rng_ranks, adapter, has_weights, expected_world_size)
    deepspeed = "latest" in names or any(n.startswith("global_step") for n in names)
    fsdp = _inspect_fsdp(path, names)
    if isinstance(fsdp, str):
        return Incomplete(path, step, fsdp)
    if fsdp is not None and not deepspeed:
        return _fsdp_checkpoint(seen, *fsdp)
    return _zero_or_plain_checkpoint(seen, deepspeed)


@dataclass(frozen=True)
class _Seen:
    """What every layout's completeness check starts from: the folder's names and its state."""

    path: Path
    step: int
    names: set[str]
    state: dict
    rng_ranks: set[int]
    adapter: bool
    has_weights: bool
    expected_world_size: int | None

    def int_field(self, key: str) -> int | None:
        value = self.state.get(key)
        return value if isinstance(value, int) else None


def _read_trainer_state(path: Path, step: int, names: set[str]) -> dict | Incomplete:
    """trainer_state.json is written last: without it, or with another step in it, no save finished."""
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
    return state


def _fsdp_checkpoint(seen: _Seen, kind: str, fsdp_ranks: set[int], fsdp_optim: bool) -> Checkpoint | Incomplete:
    """FSDP through accelerate: every rank's shard and RNG state, and the scheduler with the optimizer."""
    path, step, rng_ranks = seen.path, seen.step, seen.rng_ranks
    world = _world_from(rng_ranks | fsdp_ranks)
    if fsdp_ranks and fsdp_ranks != set(range(world)):
        return Incomplete(path, step, f"FSDP shards missing for ranks {_gaps(fsdp_ranks, world)}")
    if seen.expected_world_size is not None:
        world = max(world, seen.expected_world_size)
    if world and rng_ranks != set(range(world)):
        return Incomplete(path, step, f"RNG state missing for ranks {_gaps(rng_ranks, world)}")
    if fsdp_optim and "scheduler.pt" not in seen.names:
        return Incomplete(path, step, "FSDP optimizer state without scheduler.pt")
    return Checkpoint(
        path=path, step=step, deepspeed=False, zero_stage=None, world_size=world or None,
        train_batch_size=seen.int_field("train_batch_size"),
        has_weights=seen.has_weights, adapter=seen.adapter, has_optimizer=fsdp_optim, fsdp=kind,
        max_steps=seen.int_field("max_steps"),
    )


def _zero_or_plain_checkpoint(seen: _Seen, deepspeed: bool) -> Checkpoint | Incomplete:
    """DeepSpeed (every rank's shard under the `latest` tag) or a plain Trainer save."""
    path, step, names, rng_ranks = seen.path, seen.step, seen.names, seen.rng_ranks
    ds_tag = zero_stage = None
    shard_ranks: set[int] = set()
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
        if not seen.has_weights:
            return Incomplete(path, step, "no model weights or adapter")
    if seen.expected_world_size is not None:
        world = max(world or 0, seen.expected_world_size)
    if world and rng_ranks and rng_ranks != set(range(world)):
        # Every rank writes its own RNG state; rank 0 may write trainer_state.json first.
        return Incomplete(path, step, f"RNG state missing for ranks {_gaps(rng_ranks, world)}")
    if seen.expected_world_size and deepspeed and zero_stage and shard_ranks != set(range(world)):
        return Incomplete(path, step, f"DeepSpeed shards missing for ranks {_gaps(shard_ranks, world)}")
    if has_optimizer and not rng_ranks and not deepspeed:
        return Incomplete(path, step, "no rng_state*.pth")
    if deepspeed and ds_tag:
        optim = _file_sizes(path / ds_tag, _OPTIM_SHARD_RE)
    else:
        optim = _file_sizes(path, re.compile(r"^optimizer\.(?:pt|bin)$"))
    return Checkpoint(
        path=path, step=step, deepspeed=deepspeed, zero_stage=zero_stage, world_size=world or None,
        train_batch_size=seen.int_field("train_batch_size"),
        has_weights=seen.has_weights, adapter=seen.adapter, has_optimizer=has_optimizer, ds_tag=ds_tag,
        max_steps=seen.int_field("max_steps"),
        optimizer_bytes=sum(optim) if optim else None,
        largest_optimizer_file=max(optim) if optim else None,
    )


def _file_sizes(folder: Path, pattern: re.Pattern[str]) -> list[int]:
    """Sizes of the files in `folder` whose names match (stat only: nothing is read)."""
    out = []
    try:
        for e in os.scandir(folder):
            if pattern.match(e.name) and e.is_file():
                out.append(e.stat().st_size)
    except OSError:
        return []
    return out


def inspect_path(path: Path, output_dir: Path | None = None):
    """What is at a path a user named as `resume_from_checkpoint` (a `UserCheckpoint`).

    Its step comes from a `checkpoint-N` name, else from its trainer_state.json; a folder outside
    output_dir comes with a scan of the folder that holds it (where a replacement would be)."""
    from supervisor.judge.user_resume import UserCheckpoint

    path = Path(path)
    if not path.exists():
        return UserCheckpoint(path, None)
    m = CHECKPOINT_RE.match(path.name)
    step = int(m.group(1)) if m else None
    if step is None:
        try:
            step = json.loads((path / TRAINER_STATE).read_text()).get("global_step")
        except (OSError, ValueError, AttributeError):
            step = None
    found = (inspect_checkpoint(path, step) if isinstance(step, int)
             else Incomplete(path, None, f"no readable {TRAINER_STATE} with a global_step"))
    siblings = None if output_dir is not None and path.parent == Path(output_dir) else scan_output_dir(path.parent)
    return UserCheckpoint(path, found, siblings)


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


def apply_fixups(plan: ResumePlan, *, python: str | None = None, run_as=None) -> list[str]:
    """Do the plan's file operations; return what was done, in words.

    `python` runs the DeepSpeed converter (the job's interpreter; defaults to this one), as
    `run_as` (an Identity: on a shared box the job's user, whose interpreter and files it is).
    Raises on failure: launching after a half-applied fixup would resume the wrong state.
    """
    done: list[str] = []
    for fx in plan.fixups:
        if fx.kind == "patch_train_batch_size":
            done.append(_patch_train_batch_size(fx))
        elif fx.kind == "archive_checkpoints":
            done.extend(_archive_checkpoints(fx))
        elif fx.kind == "ds_to_universal":
            done.append(_ds_to_universal(fx, python or sys.executable, run_as))
        elif fx.kind == "slim_universal_optimizer_state":
            done.append(_slim_optimizer_state(fx, python or sys.executable, run_as))
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
    names = sorted(n for n in entries if (m := CHECKPOINT_RE.match(n)) and (fx.path / n).is_dir()
                   and (fx.value is None or int(m.group(1)) > fx.value))
    finals = [] if fx.value is not None else sorted(
        n for n in entries if _FINAL_WEIGHTS_RE.match(n) and (fx.path / n).is_file())
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


def _ds_to_universal(fx: Fixup, python: str, run_as=None) -> str:
    from supervisor.run.identity import as_user_kwargs

    assert fx.target is not None
    if not fx.target.is_dir():
        tmp = fx.target.with_name(fx.target.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)  # our own leftover from an interrupted conversion
        # --inject_missing_state: ZeRO-1/2 checkpoints written through transformers carry no
        # `universal_checkpoint_info` and the converter asserts without it (ZeRO-3 ignores the flag).
        subprocess.run(
            [python, "-m", "deepspeed.checkpoint.ds_to_universal", "--inject_missing_state",
             "--input_folder", str(fx.path / fx.value), "--output_folder", str(tmp)],
            check=True, capture_output=True, text=True, **as_user_kwargs(run_as),
        )
        os.rename(tmp, fx.target)
    # The converter names the `.partial` folder here; every universal resume writes it again.
    _atomic_write(fx.path / "latest_universal", fx.target.name)
    return fx.describe()


# Run in the job's interpreter (the daemon never imports torch): keep what DeepSpeed's ZeRO-3
# universal loader reads from zero/optimizer_state.pt (the step, the param groups, the loss-scaler
# scalars: stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3) and drop the old rank 0's
# whole optimizer state, which every rank would otherwise hold while it loads.
_SLIM = """
import os, sys, torch
src, backup = sys.argv[1], sys.argv[2]
sd = torch.load(src, weights_only=False, map_location="cpu")
osd = sd["optimizer_state_dict"]
osd["state"] = {k: {"step": v["step"]} for k, v in osd["state"].items() if "step" in v}
sd.pop("fp32_flat_groups", None)
if not os.path.exists(backup):
    os.replace(src, backup)
torch.save(sd, src + ".tmp")
os.replace(src + ".tmp", src)
print(os.path.getsize(backup), os.path.getsize(src))
"""


def _slim_optimizer_state(fx: Fixup, python: str, run_as=None) -> str:
    from supervisor.run.identity import as_user_kwargs

    assert fx.backup is not None
    if fx.backup.exists() and fx.path.exists():
        return f"{fx.path} already slimmed (original kept as {fx.backup.name})"
    res = subprocess.run([python, "-c", _SLIM, str(fx.path), str(fx.backup)], check=True, capture_output=True,
                         text=True, **as_user_kwargs(run_as))
    before, after = (int(x) for x in res.stdout.split()[-2:])
    return (f"{fx.describe()}: {before / (1 << 20):.1f} MiB -> {after / 1024:.1f} KiB (original kept as "
            f"{fx.backup.name})")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --------------------------------------------------------------------------- retention


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
