"""How far a past observation counts for a new job (pure): the tier of its match (this job, this
kind, other versions, another sequence length, a sibling size), the correction factor k = observed /
predicted per resource, and the fits and OOMs each configuration has on record."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from supervisor.judge.policy.observed import (
    TIER_ORDER,
    VERSION_FIELDS,
    Observation,
    config_sig,
    kind_of,
    setup_of,
)

# --- matching and correction ---------------------------------------------------------------

GPU_CAPACITY_TOLERANCE = 0.02  # probes differ (nvidia-smi MiB, sysfs, torch): 80 GiB vs 79.6 GiB is one GPU


def same_gpu(a: int | None, b: int | None) -> bool:
    """The same GPU capacity (both None: a CPU run), within the probes' rounding."""
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= GPU_CAPACITY_TOLERANCE * max(a, b)


def tier(target: Mapping[str, Any], seen: Mapping[str, Any]) -> str | None:
    """How close an observation's kind is to the job's: a TIER_ORDER name, or None (unrelated)."""
    a, b = kind_of(target), kind_of(seen)
    for f in ("finetuning_type", "world_size", "packing"):
        if a.get(f) != b.get(f):
            return None
    if not same_gpu(a.get("gpu_capacity"), b.get("gpu_capacity")):
        return None
    same_model = all(a.get(f) == b.get(f) for f in ("params", "hidden_size", "num_layers", "vocab_size"))
    same_seq = (a.get("cutoff_len") == b.get("cutoff_len")
                and a.get("seq_len", a.get("cutoff_len")) == b.get("seq_len", b.get("cutoff_len")))
    if same_model and same_seq:
        # An unknown version (plan, without probing the job's environment) is no difference.
        same = all(a.get(f) == b.get(f) or a.get(f) is None or b.get(f) is None for f in VERSION_FIELDS)
        return "same_kind" if same else "other_versions"
    if same_model:
        return "other_seq"
    if a.get("vocab_size") == b.get("vocab_size") and a.get("vocab_size"):
        return "sibling"
    return None


def tier_of(target: Mapping[str, Any], o: Observation, job: str | None = None) -> str | None:
    """tier(), with "same_job" for an observation of this kind under the job's own name."""
    t = tier(target, o.key)
    return "same_job" if t == "same_kind" and job and o.job == job else t


@dataclass(frozen=True)
class Correction:
    """The factor on the estimator for one resource and the observations it rests on."""

    k: float
    tier: str | None
    basis: tuple[Observation, ...]
    bounded_by_oom: bool = False
    same_setup: bool = False  # the ratio came from fits with the candidate's own setup
    unseen_setup: bool = False  # jobs of this kind were seen, none under the candidate's ZeRO/offload setup


def _ratio(seen: int | None, pred: int | None) -> float | None:
    return seen / pred if seen and pred else None


def observed_ratio(o: Observation, resource: str) -> float | None:
    """observed / predicted for one observation. GPU: of the part beyond model states (what the
    estimator guesses: activations, overhead, buffers), None for rows without the split."""
    if resource == "gpu":
        if o.predicted_gpu_states is None or not o.gpu_peak or not o.predicted_gpu:
            return None
        fixed = min(o.predicted_gpu_states, o.predicted_gpu)
        rest = o.predicted_gpu - fixed
        return max(0.0, o.gpu_peak - fixed) / rest if rest > 0 else None
    return _ratio(o.host_peak, o.predicted_host)


# The margin a correction resting on ONE fit needs besides its tier's: a single observation says
# nothing of how far the estimate misses for another configuration; n fits that agree shrink it as
# 1/sqrt(n) (issue 27: "estimator x1.00, margin 0%" after one fit, and the start ran out).
# bench_policy --scenario base --learned, night 2 first fit / cost median / p90: 0.998 1.029 1.11
# before (tier margins alone); 1.0 1.045 1.158 at 0.06; 1.0 1.034 1.146 at 0.03.
FEW_FITS = 0.03


def evidence_margin(c: Correction, resource: str) -> float:
    """How far the corrected estimate may fall short, from what it was seen to do: never below the
    error it has shown (each observation the correction rests on, predicted from the others: how
    far its observed/predicted ratio, or an OOM's lower bound, was above theirs), and FEW_FITS/sqrt(n)
    for n fits (FEW_FITS with none: lower bounds alone say only what did not fit)."""
    rs = [(o, r) for o in c.basis if (r := observed_ratio(o, resource)) is not None]
    shown = 0.0
    for i, (_, r) in enumerate(rs):
        others = [x for j, (_, x) in enumerate(rs) if j != i]
        if others and max(others) > 0:
            shown = max(shown, r / max(others) - 1)
    n = sum(1 for o, _ in rs if o.outcome == "fit")
    return max(shown, FEW_FITS / max(1, n) ** 0.5)


# A configuration counts as fitting while it fit at least this many times per OOM: one OOM (a long
# batch, a neighbour's burst) among many fits does not mark it "oom" for the kind forever.
OOM_ODDS = 2


def _config_id(o: Observation) -> tuple[Any, ...]:
    kind = tuple(sorted((k, str(v)) for k, v in kind_of(o.key).items() if k != "gpu_capacity"))
    return kind, config_sig(o.key, o.overrides)


def outweighed(observations: Sequence[Observation]) -> frozenset[int]:
    """ids of the OOMs whose own configuration (same kind) fit at least OOM_ODDS times per OOM."""
    groups: dict[tuple[Any, ...], list[Observation]] = {}
    for o in observations:
        groups.setdefault(_config_id(o), []).append(o)
    out: set[int] = set()
    for g in groups.values():
        ooms = [o for o in g if o.outcome != "fit"]
        if ooms and sum(1 for o in g if o.outcome == "fit") >= OOM_ODDS * len(ooms):
            out.update(id(o) for o in ooms)
    return frozenset(out)


def correction(target_key: Mapping[str, Any], observations: Sequence[Observation], resource: str,
               setup: tuple[Any, ...] | None = None, *, skip: frozenset[int] | None = None,
               job: str | None = None) -> Correction:
    """k for "gpu" or "host" of a candidate with `setup` (setup_of; None: any setup).

    The estimator's error is a property of the setup (which formula), so a ratio is carried
    across tiers before it is carried across setups, and never across ZeRO/offload setups:
    1. the closest tier with fits under the candidate's own setup: their largest
       observed/predicted ratio (`same_setup`);
    2. else the closest tier with fits under its ZeRO/offload setup (other checkpointing,
       allocator tuning or cap: the caller adds SETUP_MARGIN);
    3. else no fit says anything about its states: the estimator alone, raised by OOM lower
       bounds under its ZeRO/offload setup (`unseen_setup` when others were seen). A ratio seen
       with parameter offload, where states are small and unmodelled buffers dominate, carried to
       a configuration without offload would start a 14B LoRA at parameter offload for nothing.
    An OOM raises k to its lower bound when its tier is no farther than the fits' and its setup
    is as close; OOMs outweighed by fits of their own configuration (`skip`) never do."""
    skip = outweighed(observations) if skip is None else skip
    by_tier: dict[str, list[Observation]] = {}
    for o in observations:
        t = tier_of(target_key, o, job)
        if t is not None:
            by_tier.setdefault(t, []).append(o)

    def ratios(obs: Iterable[Observation]) -> list[tuple[Observation, float]]:
        return [(o, r) for o in obs if (r := observed_ratio(o, resource)) is not None]

    def near(o: Observation, level: str) -> bool:
        if level == "any":
            return True
        seen = setup_of(o.key, o.overrides)
        return seen == setup if level == "setup" else seen[1:4] == setup[1:4]  # type: ignore[index]

    levels = ("setup", "states") if setup is not None else ("any",)
    for level in levels:
        for i, t in enumerate(TIER_ORDER):
            fits = ratios(o for o in by_tier.get(t, []) if o.outcome == "fit" and near(o, level))
            if not fits:
                continue
            k = max(r for _, r in fits)
            lbs = ratios(o for tt in TIER_ORDER[:i + 1] for o in by_tier.get(tt, [])
                         if o.outcome == f"{resource}_oom" and id(o) not in skip and near(o, level))
            raised = bool(lbs) and max(r for _, r in lbs) > k
            k = max([k, *(r for _, r in lbs)])
            return Correction(k, t, tuple(o for o, _ in fits) + tuple(o for o, _ in lbs), raised, level == "setup")
    level = levels[-1]
    lbs = ratios(o for t in TIER_ORDER for o in by_tier.get(t, [])
                 if o.outcome == f"{resource}_oom" and id(o) not in skip and near(o, level))
    unseen = setup is not None and any(by_tier.values())
    if lbs:
        return Correction(max(1.0, *(r for _, r in lbs)), None, tuple(o for o, _ in lbs), True, unseen_setup=unseen)
    return Correction(1.0, None, (), unseen_setup=unseen)


@dataclass(frozen=True)
class Record:
    """Every attempt of one configuration of this job's kind, weighed (not newest-wins)."""

    fits: tuple[Observation, ...]
    ooms: tuple[Observation, ...]

    @property
    def fit(self) -> bool:
        return bool(self.fits) and len(self.fits) >= OOM_ODDS * len(self.ooms)

    def peak(self, resource: str) -> int | None:
        """A fit's: the largest peak it was seen at; an OOM's: the largest lower bound."""
        vals = [getattr(o, f"{resource}_peak") for o in (self.fits if self.fit else self.ooms)]
        return max([v for v in vals if v is not None], default=None)

    @property
    def host_limit(self) -> int | None:
        """The tightest host limit it fit under."""
        return min([o.host_limit for o in self.fits if o.host_limit], default=None)


def records(same_kind: Sequence[Observation]) -> dict[tuple[Any, ...], Record]:
    """config_sig -> Record, over observations of this job's own kind."""
    fits: dict[tuple[Any, ...], list[Observation]] = {}
    ooms: dict[tuple[Any, ...], list[Observation]] = {}
    for o in same_kind:
        (fits if o.outcome == "fit" else ooms).setdefault(config_sig(o.key, o.overrides), []).append(o)
    return {sig: Record(tuple(fits.get(sig, ())), tuple(ooms.get(sig, ()))) for sig in {*fits, *ooms}}
