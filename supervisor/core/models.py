"""Records every layer shares: frozen, JSON-friendly, no I/O.

This module is the root of the import graph. Detection (diagnosis), choice
(policy) and action (daemon) all speak in these types, so none of them needs to
import another to understand its output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from supervisor.core.compat import StrEnum


class Category(StrEnum):
    """Why an attempt ended. The names are a public vocabulary (CLI JSON, DB)."""

    GPU_OOM = "gpu_oom"
    HOST_OOM = "host_oom"
    COMM_FAILURE = "comm_failure"
    HANG = "hang"
    CONFIG_ERROR = "config_error"
    DISK_FULL = "disk_full"
    NUMERIC = "numeric"
    DEVICE_FAULT = "device_fault"
    CRASH_OTHER = "crash_other"
    # The job's surroundings failed for a while (hub/DNS/connection errors): retry, not the job's fault.
    ENVIRONMENT = "environment"
    SUCCESS = "success"
    UNKNOWN = "unknown"


class Phase(StrEnum):
    """Where in a training run the failure happened, when it can be told."""

    MODEL_LOAD = "model_load"
    TRAIN_STEP = "train_step"
    EVALUATION = "evaluation"
    CHECKPOINT_SAVE = "checkpoint_save"
    # A checkpoint being loaded to resume (weights, optimizer state, RNG): what helps here is
    # load-time memory (allocator settings, optimizer state through host memory, ZeRO offload),
    # not a smaller micro-batch. Records written before this name said "resume".
    CHECKPOINT_LOAD = "checkpoint_load"
    RESUME = "checkpoint_load"  # the old name, an alias of the same member
    UNKNOWN = "unknown"

    @classmethod
    def _missing_(cls, value: object) -> Phase | None:
        return cls.CHECKPOINT_LOAD if value == "resume" else None


@dataclass(frozen=True)
class Evidence:
    """One log line a conclusion was drawn from (1-based line number)."""

    line_no: int
    text: str
    rule: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Candidate:
    """A category an `unknown` verdict could not rule out, with the lines that point to it (1-based
    line numbers): where a person should look, never a verdict (nothing acts on it)."""

    category: Category
    lines: tuple[tuple[int, str], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"category": str(self.category), "lines": [{"line": n, "text": t} for n, t in self.lines]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Candidate:
        return cls(Category(d["category"]), tuple((int(x["line"]), str(x["text"])) for x in d.get("lines") or ()))


@dataclass(frozen=True)
class ExitRecord:
    """How the attempt's main process ended, as the launch shim saw it.

    `returncode` follows subprocess conventions (negative = killed by signal);
    `stopped_by` names the supervisor's own reason when it tore the attempt
    down (fatal_signal, hang, cancel, shutdown), so a SIGKILL we sent is never
    mistaken for the kernel OOM killer.
    """

    returncode: int | None
    signal: str | None = None
    duration_s: float | None = None
    stopped_by: str | None = None
    # The shim's own word when the command could not be started at all (exec failed: missing
    # program or workdir, NUL in the environment). Structural: it was never the training.
    launch_error: str | None = None
    # On several nodes: the node whose exit decided (each node's shim writes its own record).
    node: str | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExitRecord:
        return cls(**{f.name: d.get(f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class HostEvidence:
    """Facts gathered at the edge (cgroup, kernel log, samples, statvfs, the scheduler)."""

    cgroup_oom_kills: int | None = None
    # Kernel log lines from the attempt's time window that may explain its end: OOM-killer lines,
    # GPU driver faults (NVRM Xid, amdgpu), PCIe AER errors. The diagnosis decides what they mean.
    kernel_lines: tuple[str, ...] = ()
    # Whether the kernel log could be read for that window (None: not tried). A kernel log that was
    # read and shows no OOM kill is evidence too; one that could not be read is said, not assumed.
    kernel_log_read: bool | None = None
    min_available_bytes: int | None = None
    peak_rss_bytes: int | None = None
    memory_limit_bytes: int | None = None
    limit_mechanism: str | None = None  # "cgroup-v1", "cgroup-v2", "rlimit-data+sampled-pss", "slurm-cgroup"
    # The supervisor itself stopped the tree because the sampled sum of its processes' PSS went
    # over the job's limit (no cgroup could be made): structural host-OOM evidence.
    limit_enforced_kill: bool = False
    # statvfs of the folders the job writes (output_dir, the attempt folder): path -> free bytes.
    free_bytes: Mapping[str, int] = field(default_factory=dict)
    # A batch scheduler's verdict on the job (Slurm: OUT_OF_MEMORY, TIMEOUT, NODE_FAIL, PREEMPTED,
    # CANCELLED), when one ran it: structural, like the exit status.
    scheduler_state: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kernel_lines"] = list(self.kernel_lines)
        d["free_bytes"] = dict(self.free_bytes)
        return d


@dataclass(frozen=True)
class Diagnosis:
    """Why an attempt failed, with the evidence it rests on.

    `numbers` holds parsed quantities in bytes (tried_to_allocate,
    total_capacity, free, allocated_by_pytorch, reserved_unallocated, allowed,
    device_index, shortfall, ...); absent values are simply missing keys. Also:
    `held_by_others` = total_capacity - free - process_in_use (GPU memory neither this
    process nor the free pool holds: other processes; wait, do not shrink the job), only
    when all three are printed; `reserved_unallocated` whenever parseable (count it even
    when smaller than the request); `scheduler_state` (explain/Slurm); `required` /
    `hardware_limit` (Triton's per-block resources, not memory capacity); `scanner_errors`
    (log lines the scanner skipped after an internal error); `timeout_ms` (NCCL watchdog).
    """

    category: Category
    summary: str
    subkind: str | None = None
    vendor: str = "unknown"  # hip | cuda | cpu | unknown
    phase: Phase = Phase.UNKNOWN
    rank: int | None = None
    numbers: Mapping[str, Any] = field(default_factory=dict)
    evidence: tuple[Evidence, ...] = ()
    fragmentation: bool = False
    # How sure the verdict is: "structural" (an exception that ends a traceback, the exit status,
    # kernel/cgroup counters, the scheduler, statvfs) or "hint" (free text anywhere else in the
    # log). Only structural evidence may tear an attempt down, fail a job or pause the queue.
    strength: str = "structural"
    # A stable identity of the failure (category + the normalised line that decided it), so the
    # policy can tell "the same crash again, no progress" from a new one.
    fingerprint: str | None = None
    # The node it happened on, for an attempt that ran on several (its exit record, its rank,
    # or the scheduler's word that the node failed).
    node: str | None = None
    # For an `unknown` verdict only: the two likeliest categories and the lines pointing to each.
    candidates: tuple[Candidate, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "category": str(self.category),
            "summary": self.summary,
            "subkind": self.subkind,
            "vendor": self.vendor,
            "phase": str(self.phase),
            "rank": self.rank,
            "numbers": dict(self.numbers),
            "evidence": [e.to_dict() for e in self.evidence],
            "fragmentation": self.fragmentation,
            "strength": self.strength,
            "fingerprint": self.fingerprint,
            "node": self.node,
            "candidates": [c.to_dict() for c in self.candidates],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Diagnosis:
        return cls(
            category=Category(d["category"]),
            summary=d.get("summary", ""),
            subkind=d.get("subkind"),
            vendor=d.get("vendor", "unknown"),
            phase=Phase(d.get("phase", "unknown")),
            rank=d.get("rank"),
            numbers=dict(d.get("numbers") or {}),
            evidence=tuple(Evidence(**e) for e in d.get("evidence") or ()),
            fragmentation=bool(d.get("fragmentation", False)),
            strength=d.get("strength", "structural"),
            fingerprint=d.get("fingerprint"),
            node=d.get("node"),
            candidates=tuple(Candidate.from_dict(c) for c in d.get("candidates") or ()),
        )


@dataclass(frozen=True)
class Overrides:
    """The cumulative configuration changes an attempt runs with.

    Attempt 1 runs with `Overrides()` (the user's config as is). Each remedy
    produces a new Overrides from the previous one; the renderer turns it into
    files. `rungs` lists applied remedy names in order; `yaml` are
    LLaMA-Factory keys set; `env` environment variables set; `deepspeed` a
    generated DeepSpeed config (or None to keep the user's); `notes` say in
    words what each change costs.
    """

    rungs: tuple[str, ...] = ()
    yaml: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    deepspeed: Mapping[str, Any] | None = None
    notes: tuple[str, ...] = ()
    # A learned start's own account (judge/policy/learn.py): what it was chosen over and the
    # configuration last seen to fit, so that its OOM goes back there (judge/policy/fallback.py).
    # Not part of the configuration: a rung's Overrides never carries it on.
    learned: Mapping[str, Any] | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "rungs": list(self.rungs),
            "yaml": dict(self.yaml),
            "env": dict(self.env),
            "deepspeed": dict(self.deepspeed) if self.deepspeed is not None else None,
            "notes": list(self.notes),
        }
        if self.learned is not None:
            d["learned"] = dict(self.learned)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Overrides:
        if not d:
            return cls()
        return cls(
            rungs=tuple(d.get("rungs") or ()),
            yaml=dict(d.get("yaml") or {}),
            env=dict(d.get("env") or {}),
            deepspeed=d.get("deepspeed"),
            notes=tuple(d.get("notes") or ()),
            learned=d.get("learned"),
        )

    def fingerprint(self) -> str:
        """Stable identity of the configuration, to never repeat a failed one."""
        import json

        body = {k: v for k, v in self.to_dict().items() if k not in ("rungs", "notes", "learned")}
        return json.dumps(body, sort_keys=True, default=str)


@dataclass(frozen=True)
class Change:
    """One concrete change a remedy makes, said in words."""

    target: str  # "yaml" | "env" | "deepspeed"
    key: str
    old: Any
    new: Any
    why: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class DecisionKind(StrEnum):
    RETRY = "retry"  # same configuration, after a backoff
    WAIT = "wait"  # same configuration, after a longer wait: the surroundings failed, not the job
    ESCALATE = "escalate"  # a new configuration (a remedy rung)
    FAIL = "fail"  # stop; reason says why in words
    PAUSE = "pause"  # pause the whole queue (e.g. disk full)
    DONE = "done"  # the attempt succeeded


@dataclass(frozen=True)
class Decision:
    kind: DecisionKind
    reason: str
    delay_s: float = 0.0
    rung: str | None = None
    overrides: Overrides | None = None  # what the next attempt runs with
    changes: tuple[Change, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "reason": self.reason,
            "delay_s": self.delay_s,
            "rung": self.rung,
            "overrides": self.overrides.to_dict() if self.overrides else None,
            "changes": [c.to_dict() for c in self.changes],
        }


@dataclass(frozen=True)
class JobContext:
    """What the policy may know about a job (no handles, no paths to open)."""

    id: int
    name: str
    kind: str  # "llamafactory" | "command"
    config: Mapping[str, Any]  # the user's LLaMA-Factory config (no supervisor block)
    world_size: int = 1
    max_attempts: int = 8
    param_count: int | None = None  # from the model's config.json, when readable
    largest_layer_params: int | None = None
    gpu_capacity_bytes: int | None = None
    host_ram_bytes: int | None = None
    torch_version: str | None = None
    transformers_version: str | None = None
    uses_vllm: bool = False
    # The user's DeepSpeed config, read at the edge when `deepspeed:` is a path (the policy
    # needs its ZeRO stage and offload to judge remedies and checkpoint compatibility).
    deepspeed_config: Mapping[str, Any] | None = None
    # hidden_size, num_layers, vocab_size from the model's config.json (policy.estimate.read_model_shape),
    # so the policy can predict activation memory per micro-batch and sequence length.
    model_shape: Mapping[str, int] | None = None
    # The world size LLaMA-Factory really launches (its launcher runs torchrun on every visible
    # GPU unless NPROC_PER_NODE says otherwise): the job's pinned ranks (supervisor
    # `nproc_per_node`, or NPROC_PER_NODE in its env), its `gpus:`, and, when neither is given,
    # how many GPUs its launch sees (0 on a CPU-only box; None when not probed).
    nproc_per_node: int | None = None
    gpus: tuple[int, ...] | None = None
    visible_gpu_count: int | None = None
    # Nodes the launch spans (a Slurm job with `nodes: N` runs one torchrun per node): the world
    # is nodes x ranks per node, and the effective batch is kept across all of it.
    nnodes: int = 1
    # One host-RAM budget for every remedy: the job's own limit when it has one, else the box's
    # RAM minus what other processes hold now (bytes) and the policy's reserve.
    host_memory_limit_bytes: int | None = None
    host_used_by_others_bytes: int | None = None
    # Who else holds memory on the job's GPUs, when a probe can tell ("pid 4242 (python3): 70.0 GiB"),
    # so a wait-and-retry can name them.
    gpu_memory_holders: tuple[str, ...] = ()
    # Token lengths of the training set's samples when the edge knows them ({"p50": .., "p95": ..,
    # "max": ..}): without packing a micro-batch is padded to its longest sample, not to cutoff_len,
    # so two jobs of one model and cutoff_len on different data use different memory.
    dataset_token_lengths: Mapping[str, int] | None = None

    def launched_world_size(self) -> int:
        """Ranks the launch really runs (ranks per node x nodes): a remedy must never change it."""
        return self.ranks_per_node() * max(1, self.nnodes)

    def ranks_per_node(self) -> int:
        if self.nproc_per_node:
            return self.nproc_per_node
        if self.gpus:
            return len(self.gpus)
        if self.visible_gpu_count:
            return self.visible_gpu_count
        return max(1, self.world_size // max(1, self.nnodes))

    def host_budget_bytes(self, reserve: float = 0.1) -> int | None:
        """Host RAM this job may use: its limit if set, else RAM x (1 - reserve) - others' use."""
        if self.host_memory_limit_bytes:
            return self.host_memory_limit_bytes
        if not self.host_ram_bytes:
            return None
        return max(0, int(self.host_ram_bytes * (1 - reserve)) - (self.host_used_by_others_bytes or 0))


@dataclass(frozen=True)
class AttemptRecord:
    """One finished attempt as the policy sees it."""

    number: int
    overrides: Overrides
    diagnosis: Diagnosis | None
    exit: ExitRecord | None
    resumed_from_step: int | None = None
    max_step: int | None = None
    checkpoint_step_after: int | None = None  # last complete checkpoint when it ended
    decision: str | None = None  # DecisionKind taken after it


@dataclass(frozen=True)
class Problem:
    """One thing wrong with user input, said precisely enough to fix it.

    `key` is a dotted path into the job file ("deepspeed.zero_optimization.x");
    `line` is filled in by the job-file loader where it can be told.
    """

    key: str
    message: str
    suggestion: str | None = None
    line: int | None = None

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line else ""
        hint = f" (did you mean {self.suggestion!r}?)" if self.suggestion else ""
        return f"{where}{self.key}: {self.message}{hint}"
