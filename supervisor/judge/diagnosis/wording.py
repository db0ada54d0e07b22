"""How a chosen cause is told (pure): its summary in words, the numbers it rests on, its evidence
lines and its fingerprint. conclude.py chooses the cause; this module says it."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from supervisor.core.models import Category, Diagnosis, Evidence, Phase
from supervisor.judge.diagnosis.findings import ScanState
from supervisor.judge.diagnosis.hits import HINT, Hit
from supervisor.judge.diagnosis.sizes import human

MIB = 1024**2
NEAR_ZERO_FLOOR = 64 * MIB
NEAR_ZERO_FRACTION = 0.02
FRAG_CAPACITY_FRACTION = 0.05
FRAG_FLOOR = 256 * MIB
MAX_EVIDENCE = 8

_SUBKIND_WORDS = {
    "allocator": "PyTorch caching allocator",
    "driver": "driver/library allocation",
    "vllm_kv_cache": "vLLM KV cache does not fit",
    "vllm_startup": "vLLM start-up memory check",
    "batch_size_search_exhausted": "automatic batch-size search reached zero",
    "cpu_allocator": "PyTorch CPU allocator",
    "pinned": "pinned (page-locked) host memory",
    "python_memory_error": "Python MemoryError",
    "bad_alloc": "C++ std::bad_alloc or Rust's failed allocation",
    "enomem": "the OS refused memory (ENOMEM)",
    "oom_killer": "killed by the kernel OOM killer",
}


@dataclass
class Root:
    """A chosen cause: the finding it rests on (if any) and extra evidence."""

    hit: Hit
    line_no: int
    text: str
    rank: int | None
    phase: Phase
    notes: list[str] = field(default_factory=list)
    extra: list[Evidence] = field(default_factory=list)
    line_rule: str | None = None  # the log rule that matched root.line_no, when not hit.rule


def oom_numbers(nums: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    n = dict(nums)
    tried = n.get("tried_to_allocate")
    if tried is None:
        return n, False
    free = n.get("free")
    usable = free
    allowed = n.get("allowed")
    if allowed is not None:
        used = n.get("allocated_by_pytorch", 0) + n.get("reserved_unallocated", 0) + n.get("private_pools", 0)
        headroom = max(0, allowed - used)
        usable = headroom if free is None else min(free, headroom)
    if usable is not None:
        n["shortfall"] = max(0, tried - usable)
    ru = n.get("reserved_unallocated")
    frag = False
    if ru is not None:
        cap = n.get("total_capacity")
        if allowed is not None:
            cap = min(cap, allowed) if cap else allowed
        floor = FRAG_CAPACITY_FRACTION * cap if cap else FRAG_FLOOR
        frag = ru >= tried and ru >= floor
    return n, frag


def _vendor(root: Root | None, state: ScanState) -> str:
    if root is not None and root.hit.category is Category.HOST_OOM:
        return "cpu"
    if state.hip or (root is not None and root.hit.vendor == "hip"):
        return "hip"
    if root is not None and root.hit.vendor in ("cuda", "cpu"):
        return root.hit.vendor
    return "cuda" if state.cuda else "unknown"


def _where(root: Root, state: ScanState) -> str:
    bits = []
    if root.rank is not None:
        bits.append(f"on rank {root.rank}")
    if root.phase is not Phase.UNKNOWN:
        bits.append(f"during {root.phase.value}")
    if state.last_step is not None:
        bits.append(f"(last step seen {state.last_step})")
    return (" " + " ".join(bits)) if bits else ""


def _summary(root: Root, nums: dict[str, Any], frag: bool, state: ScanState, vendor: str) -> str:
    cat = root.hit.category
    sub = root.hit.subkind or ""
    where = _where(root, state)
    words = _SUBKIND_WORDS.get(sub, sub.replace("_", " "))
    line = f"line {root.line_no}" if root.line_no else "host evidence"
    if cat is Category.GPU_OOM:
        s = f"GPU out of memory{where} [{vendor}, {words}]"
        if "tried_to_allocate" in nums:
            s += f": tried to allocate {human(nums['tried_to_allocate'])}"
            if "free" in nums:
                s += f" with {human(nums['free'])} free"
            if "total_capacity" in nums:
                s += f" of {human(nums['total_capacity'])}"
            if "allowed" in nums:
                s += f", {human(nums['allowed'])} allowed by the memory-fraction cap"
            if "shortfall" in nums:
                s += f"; short by {human(nums['shortfall'])}"
        if "reserved_unallocated" in nums:
            s += f"; {human(nums['reserved_unallocated'])} reserved by PyTorch but unallocated"
            if frag:
                s += " (fragmentation: the cache held enough, not in one block)"
        if nums.get("held_by_others_inferred"):
            s += (f"; {human(nums['not_held_by_pytorch'])} of the GPU is in use outside this process's PyTorch"
                  f" allocator: {human(nums['held_by_others'])} of it counted as held by other processes")
            s += (" (the process listed with the use that covers PyTorch's reservation is this one)"
                  if "process_in_use" in nums else
                  " (beyond an allowance for this process's own context and library buffers: the message cannot"
                  " tell other processes from this process's non-PyTorch memory)")
        s += f" ({line})."
    elif cat is Category.HOST_OOM:
        s = f"Host (CPU) memory exhausted{where} [{words}]"
        if "tried_to_allocate" in nums:
            s += f": tried to allocate {human(nums['tried_to_allocate'])}"
        s += f" ({line})."
    elif cat is Category.DEVICE_FAULT:
        s = f"GPU device fault{where} [{vendor}, {words}] ({line}): {root.text[:200]}"
    elif cat is Category.COMM_FAILURE:
        s = f"Collective communication failure{where} [{words}] ({line}): {root.text[:200]}"
    elif cat is Category.CONFIG_ERROR:
        s = f"Configuration error [{words}] ({line}): {root.text[:300]}"
    elif cat is Category.DISK_FULL:
        s = f"Disk full or write failed{where} [{words}] ({line}): {root.text[:200]}"
    elif cat is Category.ENVIRONMENT:
        s = (f"Transient environment failure{where} [{words}] ({line}): {root.text[:300]}"
             " (the network or the model hub; a retry later is expected to work)")
    elif cat is Category.NUMERIC:
        s = f"Numerical failure{where} [{words}] ({line}): {root.text[:200]}"
    else:
        s = f"Crash{where} [{words}] ({line}): {root.text[:300]}"
    for note in root.notes:
        s += f" Note: {note}."
    return s


def recovered_note(state: ScanState) -> str:
    rec = [f for f in state.findings if f.recovered and f.category in (Category.GPU_OOM, Category.HOST_OOM)]
    if not rec:
        return ""
    f = rec[0]
    return (f" {len(rec)} out-of-memory error(s) were caught and retried inside the program"
            f" (first at line {f.line_no}; {'; '.join(f.notes) or 'training continued'}).")


# What the lines before a failure say the run was doing, when neither a traceback's frames nor the
# trainer's markers did: an evaluation bar, training progress (a bar in it/s, an epoch/iter/step
# counter, a loss value), a model being loaded, a checkpoint being saved. Read from the tail, nearest first.
_TAIL_PHASES: tuple[tuple[re.Pattern[str], Phase], ...] = (
    (re.compile(r"\b(?:[Ee]val\w*|[Vv]alidat\w*|[Pp]redict\w*)\b[^\n]*\d+%\|"), Phase.EVALUATION),
    (re.compile(r"\d+/\d+ \[[\d:]+<[\d:?]+,\s*[\d.?]+\s*(?:it/s|s/it|\w+/s|s/\w+)|\b(?:[Ee]poch|iter(?:ation)?|step)"
                r"\s*[:=]?\s*\d|\bloss\w*['\"]?\s*[:=]\s*[-\d.]|\b[Ss]tart(?:ing)? [Tt]raining\b"), Phase.TRAIN_STEP),
    (re.compile(r"\b(?:[Ll]oading|[Ii]nitiali[sz]ing)\b.*\b(?:model|weights|tensors|decoder|encoder|shards|pretrained)\b"),
     Phase.MODEL_LOAD),
    (re.compile(r"\b[Ss]aving\b.*\b(?:checkpoint|model|weights)\b"), Phase.CHECKPOINT_SAVE),
)


def _tail_phase(state: ScanState, before: int) -> Phase:
    for n, text in reversed(state.program_tail()):
        if before and n >= before:
            continue
        for rx, phase in _TAIL_PHASES:
            if rx.search(text):
                return phase
    return Phase.UNKNOWN


def diagnosis_of(root: Root, state: ScanState, extra_summary: str = "", strength: str = "structural") -> Diagnosis:
    if root.phase is Phase.UNKNOWN:
        root.phase = _tail_phase(state, root.line_no)
        if root.phase is Phase.UNKNOWN and root.hit.category is Category.NUMERIC:
            root.phase = Phase.TRAIN_STEP  # losses and loss scales exist only while training
    vendor = _vendor(root, state)
    nums, frag = dict(root.hit.numbers), False
    if root.hit.category is Category.GPU_OOM:
        nums, frag = oom_numbers(nums)
    evidence: list[Evidence] = []
    if root.line_no:
        evidence.append(Evidence(line_no=root.line_no, text=root.text, rule=root.line_rule or root.hit.rule))
    evidence.extend(root.extra)
    for f in state.findings:  # supporting lines: other decisive findings, kill markers, launcher summary
        if len(evidence) >= MAX_EVIDENCE:
            break
        if f.line_no == root.line_no and f.rule in (root.hit.rule, root.line_rule):
            continue
        if f.recovered or f.tier == HINT:
            continue
        if any(e.rule == f.rule and e.line_no == f.line_no for e in evidence):
            continue
        evidence.append(f.evidence())
    summary = _summary(root, nums, frag, state, vendor) + extra_summary + recovered_note(state)
    return Diagnosis(
        category=root.hit.category,
        summary=summary.strip(),
        subkind=root.hit.subkind,
        vendor=vendor,
        phase=root.phase,
        rank=root.rank,
        numbers=nums,
        evidence=tuple(evidence[:MAX_EVIDENCE]),
        fragmentation=frag,
        strength=strength,
    )


def plain(category: Category, subkind: str | None, summary: str, state: ScanState,
           evidence: tuple[Evidence, ...] = (), phase: Phase | None = None) -> Diagnosis:
    return Diagnosis(
        category=category,
        summary=summary.strip(),
        subkind=subkind,
        vendor="hip" if state.hip else ("cuda" if state.cuda else "unknown"),
        phase=state.context_phase if phase is None else phase,
        evidence=evidence[:MAX_EVIDENCE],
    )


def tail_evidence(state: ScanState, n: int = 3) -> tuple[Evidence, ...]:
    lines = [(no, t) for no, t in state.tail if t.strip()]
    return tuple(Evidence(line_no=no, text=t.strip()[:500], rule="tail") for no, t in lines[-n:])


_NORM_RES = (
    (re.compile(r"\[(?:rank|default)\d+\]:|\[(?:PG [^\]]*?)?Rank \d+\]"), ""),
    (re.compile(r"0x[0-9a-fA-F]+"), "0x"),
    (re.compile(r"(?:[\w.~-]*/)+[\w.-]*"), "<path>"),
    (re.compile(r"\d+(?:[.,:]\d+)*"), "N"),
    (re.compile(r"\s+"), " "),
)


def normalise_line(text: str) -> str:
    """A log line without what changes between attempts: ranks, addresses, paths, numbers."""
    for rx, sub in _NORM_RES:
        text = rx.sub(sub, text)
    return text.strip()[:300]


def fingerprint(d: Diagnosis) -> str:
    """category/subkind + a hash of the normalised deciding line: the same failure again gives the same."""
    line = next((e.text for e in d.evidence if e.rule != "tail"), "")
    digest = hashlib.sha1(normalise_line(line).encode()).hexdigest()[:12] if line else "-"
    return f"{d.category.value}/{d.subkind or '-'}/{digest}"
