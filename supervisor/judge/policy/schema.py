"""Policy files: declarative escalation ladders, validated as strictly as job files.

A policy names the remedies (rungs) it may use, in the order of their cost,
their parameters, and the budgets per failure cause. Loading refuses unknown
keys with the nearest valid one, and refuses a data-changing rung in a policy
that has not said `allow_data_changes: true`.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from supervisor import SOURCE_ROOT
from supervisor.core.models import Problem

RungName = Literal[
    "allocator", "micro_batch", "eval_batch", "grad_checkpointing",
    "zero3_offload_optimizer", "zero3_offload_param", "memory_fraction", "cutoff_len", "universal_load",
    "sharded_save",
]
ALL_RUNGS: tuple[str, ...] = RungName.__args__  # type: ignore[attr-defined]
DATA_CHANGING_RUNGS = frozenset({"cutoff_len"})
# Rungs a generic command job can take: they act through the environment only.
ENV_ONLY_RUNGS = frozenset({"allocator", "memory_fraction"})

BUILTIN_POLICY_DIR = SOURCE_ROOT / "policies"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Budgets(_Strict):
    """How many attempts each cause may use before the job fails."""

    max_attempts: int = Field(10, ge=1, le=100)
    oom_escalations: int = Field(6, ge=0)
    transient_retries: int = Field(3, ge=0)  # comm failures, hangs, unexplained crashes
    no_progress_attempts: int = Field(5, ge=1)  # consecutive attempts with no new checkpoint
    device_fault_retries: int = Field(1, ge=0)
    numeric_retries: int = Field(0, ge=0)
    environment_retries: int = Field(5, ge=0)  # hub / DNS / network failures outside the job
    # Then the job waits for the surroundings to come back (not failed: the outage is not its
    # fault): a try every `environment_wait_s`, for at most `environment_wait_max_s` in all.
    environment_wait_s: float = Field(720.0, gt=0)
    environment_wait_max_s: float = Field(4 * 3600.0, ge=0)
    foreign_memory_retries: int = Field(4, ge=0)  # GPU memory held by other processes: wait for it


class Backoff(_Strict):
    """tenacity's exponential wait, plus a jitter derived from the job and retry number."""

    initial_s: float = Field(30.0, ge=0)
    max_s: float = Field(900.0, ge=0)
    exp_base: float = Field(2.0, ge=1)
    jitter_s: float = Field(10.0, ge=0)


class AllocatorRung(_Strict):
    garbage_collection_threshold: float = Field(0.8, gt=0, lt=1)
    max_split_size_mb: list[int] = Field(default_factory=lambda: [512, 256, 128], min_length=1)
    expandable_segments: Literal["never", "cuda", "always"] = "cuda"

    @model_validator(mode="after")
    def _splits(self) -> AllocatorRung:
        if any(v < 20 for v in self.max_split_size_mb):
            raise ValueError("max_split_size_mb values must be >= 20 (PyTorch refuses smaller)")
        if list(self.max_split_size_mb) != sorted(self.max_split_size_mb, reverse=True):
            raise ValueError("max_split_size_mb must decrease step by step")
        return self


class MicroBatchRung(_Strict):
    floor: int = Field(1, ge=1)


class MemoryFractionRung(_Strict):
    fraction: float = Field(0.88, gt=0.1, le=1.0)
    # torch releases whose allocator parses `per_process_memory_fraction` from the
    # environment (pytorch/pytorch#161035); older ones get the startup hook.
    env_option_min_torch: str = "2.10"


class CutoffRung(_Strict):
    factor: float = Field(0.5, gt=0, lt=1)
    floor: int = Field(256, ge=16)


class GradCheckpointRung(_Strict):
    allow_unsloth_gc: bool = True


class RungSettings(_Strict):
    allocator: AllocatorRung = AllocatorRung()
    micro_batch: MicroBatchRung = MicroBatchRung()
    eval_batch: MicroBatchRung = MicroBatchRung()
    grad_checkpointing: GradCheckpointRung = GradCheckpointRung()
    memory_fraction: MemoryFractionRung = MemoryFractionRung()
    cutoff_len: CutoffRung = CutoffRung()


class Retention(_Strict):
    """How many set-aside checkpoint folders to keep per output_dir (older ones are removed;
    the archive holding the only complete checkpoint left is always kept)."""

    keep_quarantined: int = Field(2, ge=0)
    keep_archived: int = Field(2, ge=0)


class FewerGpus(_Strict):
    """When the GPUs a job asked for are not all free (taken, faulted, removed): wait `after_s` for
    them, then run on the free ones if `allow`, resuming across the world-size change (ZeRO
    checkpoints through DeepSpeed's universal format) with the effective batch kept exactly
    (gradient accumulation adjusted); the start says so. `allow: false` waits as long as it takes
    (and refuses at once a job that asks for more GPUs than the box has)."""

    allow: bool = True
    after_s: float = Field(1800.0, ge=0)


class Policy(_Strict):
    """An escalation policy. `ladder` is the default order (cheapest first);
    the diagnosis may reorder it (see decide.py)."""

    name: str
    description: str = ""
    allow_data_changes: bool = False
    ladder: list[RungName] = Field(min_length=1)
    rungs: RungSettings = RungSettings()
    budgets: Budgets = Budgets()
    backoff: Backoff = Backoff()
    retention: Retention = Retention()
    fewer_gpus: FewerGpus = FewerGpus()
    retry_numeric: bool = False
    # The start-up hook's emergency checkpoint of the last finished step on a catchable OOM (one
    # process): on by default; a job turns it off with env OOM_SUPERVISOR_EMERGENCY_CKPT: "0".
    emergency_checkpoint: bool = True
    # Seconds a multi-rank (DDP replica) emergency save may take in all, the other ranks' RNG
    # included (OOM_SUPERVISOR_EMERGENCY_BUDGET_S); None: the hook's own default, 300 s.
    emergency_budget_s: float | None = Field(default=None, gt=0)
    # Switching a run to DeepSpeed (or between ZeRO stages) cannot load the
    # checkpoints it already wrote; with this false such a rung is skipped.
    allow_restart_for_deepspeed: bool = False
    # When a checkpoint's optimizer state cannot be loaded by the next configuration:
    # convert it with DeepSpeed's universal checkpoint (keeps optimizer and schedule) ...
    allow_universal_checkpoint: bool = True
    # An OOM while a ZeRO-3 full fine-tune saves (the 16-bit weights gathered onto rank 0): save
    # shards only from then on (rungs.sharded_save); the weights then come from zero_to_fp32.py.
    allow_sharded_save: bool = True
    # ... or continue from its weights alone with a fresh optimizer (a semantic change,
    # recorded loudly). Off by default: never silently.
    allow_weights_only: bool = False
    # Share of the box's RAM never counted as available to a job (page cache, the daemon, the
    # system), when the job has no host_memory_limit of its own.
    host_ram_reserve: float = Field(0.1, ge=0.0, lt=0.9)
    # Host RAM that other processes hold when an attempt is about to start is waited for (the job
    # unchanged, never refused: hostwait.py), asked again every host_wait_poll_s, at most
    # host_wait_max_s in all; then the attempt starts anyway.
    host_wait_max_s: float = Field(3600.0, ge=0)
    host_wait_poll_s: float = Field(60.0, gt=0)
    shortfall_margin: float = Field(1.15, ge=1.0)
    # A configuration is predicted to fit when it needs at most (1 - fit_headroom) of the GPU.
    fit_headroom: float = Field(0.05, ge=0.0, lt=0.5)
    # Combine up to this many rungs into one step when no single one is predicted to fit.
    max_combined_rungs: int = Field(3, ge=1, le=4)

    @model_validator(mode="after")
    def _ladder(self) -> Policy:
        if len(set(self.ladder)) != len(self.ladder):
            raise ValueError("ladder names a rung twice")
        data = [r for r in self.ladder if r in DATA_CHANGING_RUNGS]
        if data and not self.allow_data_changes:
            raise ValueError(f"ladder has {data}, which changes the training data; "
                             "set allow_data_changes: true to allow it")
        return self


class PolicyError(ValueError):
    def __init__(self, problems: list[Problem], source: str) -> None:
        self.problems = problems
        self.source = source
        super().__init__(f"{source}: " + "; ".join(str(p) for p in problems))


def _fields_at(loc: Sequence[str | int]) -> list[str]:
    model: type[BaseModel] = Policy
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None) if field else None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return []
    return list(model.model_fields)


def parse_policy_text(text: str, *, source: str = "policy") -> Policy:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # Only the problem and its line: str(exc) quotes the file, which must never reach a reason.
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise PolicyError([Problem("(file)", f"YAML does not parse: {problem}", None,
                                   mark.line + 1 if mark else None)], source) from None
    if not isinstance(data, dict):
        raise PolicyError([Problem("(file)", "a policy must be a YAML mapping")], source)
    try:
        return Policy.model_validate(data)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            loc = [str(x) for x in e["loc"]]
            key = ".".join(loc) or "(file)"
            if e["type"] == "extra_forbidden":
                hits = difflib.get_close_matches(loc[-1], _fields_at(loc), n=1, cutoff=0.6)
                problems.append(Problem(key, "unknown key", hits[0] if hits else None))
            elif e["type"] == "literal_error" and loc and loc[0] == "ladder":
                hits = difflib.get_close_matches(str(e.get("input")), ALL_RUNGS, n=1, cutoff=0.5)
                problems.append(Problem(key, f"unknown rung {e.get('input')!r}; rungs are {list(ALL_RUNGS)}",
                                        hits[0] if hits else None))
            else:
                problems.append(Problem(key, e["msg"].removeprefix("Value error, ")))
        raise PolicyError(problems, source) from None


def find_policy(name: str, *, search_dirs: Sequence[Path]) -> Path | None:
    """The file of the policy called `name` (first dir wins), or None. Names only: a job's
    `policy:` is untrusted, so a path or `..` is never looked up."""
    from supervisor.intake.jobspec import policy_name_problem

    if policy_name_problem(name):
        return None
    for d in search_dirs:
        path = Path(d) / f"{name}.yaml"
        if path.is_file():
            return path
    return None


def unknown_policy_problem(name: str, *, search_dirs: Sequence[Path], key: str = "supervisor.policy") -> Problem | None:
    """None when `name` is a known policy; else the problem to show at submit/intake."""
    from supervisor.intake.jobspec import policy_name_problem

    bad = policy_name_problem(name)
    if bad:
        return Problem(key, bad)
    if find_policy(name, search_dirs=search_dirs) is not None:
        return None
    known = sorted({p.stem for d in search_dirs if Path(d).is_dir() for p in Path(d).glob("*.yaml")})
    hits = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    return Problem(key, f"no policy {name!r}; known: {', '.join(known) or 'none'}", hits[0] if hits else None)


def load_policy_by_name(name: str, *, search_dirs: Sequence[Path]) -> Policy:
    """A policy a job named: never a path (see find_policy)."""
    path = find_policy(name, search_dirs=search_dirs)
    if path is None:
        problem = unknown_policy_problem(name, search_dirs=search_dirs, key="policy")
        raise PolicyError([problem or Problem("policy", f"no policy {name!r}")], name[:64])
    return parse_policy_text(path.read_text(), source=str(path))


def load_policy(name_or_path: str, *, search_dirs: Sequence[Path]) -> Policy:
    """A policy by name (`default` -> <dir>/default.yaml, first dir wins) or by path.
    Paths are for trusted callers only (the admin's config, `plan --policy FILE`); a name
    that came from a job goes through load_policy_by_name."""
    candidate = Path(name_or_path).expanduser()
    if candidate.suffix in (".yaml", ".yml") or "/" in name_or_path:
        paths = [candidate]
    else:
        paths = [Path(d) / f"{name_or_path}.yaml" for d in search_dirs]
    for path in paths:
        if path.is_file():
            return parse_policy_text(path.read_text(), source=str(path))
    known = sorted({p.stem for d in search_dirs if Path(d).is_dir() for p in Path(d).glob("*.yaml")})
    hits = difflib.get_close_matches(name_or_path, known, n=1, cutoff=0.5)
    raise PolicyError([Problem("policy", f"no policy {name_or_path!r} in {[str(d) for d in search_dirs]}; "
                                         f"known: {known}", hits[0] if hits else None)], name_or_path)
