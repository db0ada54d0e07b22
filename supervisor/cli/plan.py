"""`oom-supervisor plan FILE`: the ladder a job would climb, without running anything.

With the model size (local config.json) and --gpu-memory known, each step
feeds decide() the OOM the estimate predicts, numbers included, and the plan
ends at the first configuration estimated to fit.

For each rung: what changes against the user's file, and the estimated GPU
and host memory of that configuration (model states by DeepSpeed's formulas,
activations by the usual per-layer estimate), so a user can see before the
night whether the remedies could ever fit. Without those numbers each step
assumes a plain out-of-memory in a training step.

When the daemon would refuse the job (LR.refusal_bound: no configuration the policy can
reach fits even under the most optimistic credible estimate), it prints the refusal, the
estimate it was judged on and every configuration's numbers under it.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
from supervisor.judge.policy import evidence as LE
from supervisor.judge.policy import learn
from supervisor.judge.policy import observed as LO
from supervisor.judge.policy import refusal as LR
from supervisor.judge.policy.decide import decide
from supervisor.judge.policy.estimate import (
    GiB,
    ModelShape,
    activation_bytes,
    context_fields,
    deepspeed_estimates,
    model_states,
    read_model_shape,
)
from supervisor.judge.policy.render import render_attempt
from supervisor.judge.policy.rungs import view_of
from supervisor.judge.policy.schema import BUILTIN_POLICY_DIR, PolicyError, load_policy

MAX_STEPS = 12


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, metavar="FILE", help="job file (as for submit)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--policy", metavar="NAME", help="policy name or path (default: the job's, else 'default')")
    parser.add_argument("--policy-dir", type=Path, action="append", default=[],
                        help="where named policies live (repeatable; the shipped ones are always searched)")
    parser.add_argument("--gpu-memory", type=float, metavar="GIB", help="GPU capacity to judge fit against")
    parser.add_argument("--host-memory", type=float, metavar="GIB",
                        help="host RAM to judge offload and refusal against (default: the job's host_memory_limit)")
    parser.add_argument("--observations", type=Path, metavar="FILE",
                        help="learned observations (default: observations.sqlite3 in the state folder)")
    parser.add_argument("--deepspeed-estimator", action="store_true",
                        help="also print DeepSpeed's own ZeRO-3 estimates (imports deepspeed, slow)")


def _context(spec: Any, shape: ModelShape | None, gpu_gib: float | None,
             host_gib: float | None = None, visible_gpus: int | None = None) -> JobContext:
    ds = spec.config.get("deepspeed")
    ds_cfg = ds if isinstance(ds, dict) else None
    if isinstance(ds, str):
        try:
            ds_cfg = json.loads(ds) if ds.strip().startswith("{") else json.loads(spec.resolve(ds).read_text())
        except (OSError, ValueError):
            ds_cfg = None
    return JobContext(id=0, name=spec.name, kind=spec.kind, config=spec.config, world_size=spec.world_size,
                      nproc_per_node=spec.sup.nproc_per_node, gpus=tuple(spec.sup.gpus) if spec.sup.gpus else None,
                      max_attempts=spec.sup.max_attempts or 8, host_memory_limit_bytes=spec.sup.host_memory_limit,
                      host_ram_bytes=int(host_gib * GiB) if host_gib else None,
                      **context_fields(shape), gpu_capacity_bytes=int(gpu_gib * GiB) if gpu_gib else None, deepspeed_config=ds_cfg,
                      visible_gpu_count=visible_gpus)


def _visible_gpus(spec: Any, gpu_gib: float | None) -> int | None:
    """0 when the job would run without a GPU on this box (none probed, none named, no
    --gpu-memory), as the daemon here would run it: no GPU-only remedy (offload) is a candidate
    then, and plan shows the start the daemon will choose (issue 27). None: not known here."""
    if gpu_gib or spec.sup.gpus:
        return None
    import os

    from supervisor.intake.llamafactory.launch import visible_gpu_count
    from supervisor.run.gpus import probe_capacities

    seen = visible_gpu_count({**os.environ, **(spec.sup.env or {})}, len(probe_capacities()))
    return 0 if seen == 0 else None  # with GPUs here, --gpu-memory says which: as before


def _estimate(ctx: JobContext, ov: Overrides, shape: ModelShape | None) -> dict[str, Any]:
    out = _numbers(ctx, ov, shape)
    if out and ctx.gpu_capacity_bytes:
        out["fits"] = out["total_gpu_gib"] * GiB <= ctx.gpu_capacity_bytes
    return out


def _numbers(ctx: JobContext, ov: Overrides, shape: ModelShape | None) -> dict[str, Any]:
    if not shape:
        return {}
    v = view_of(ctx, ov)
    gpu, host = model_states(shape.params, shape.largest_layer_params, ctx.launched_world_size(), v.setup)
    act = activation_bytes(micro_batch=v.micro, seq_len=v.cutoff, hidden=shape.hidden_size,
                           layers=shape.num_layers, checkpointing=v.gc_on, vocab=shape.vocab_size,
                           offload_checkpoints=v.unsloth_gc)
    world = ctx.launched_world_size()
    weights = (4 * shape.largest_layer_params if v.setup.offload_param
               else 2 * shape.params // (world if v.setup.zero_stage == 3 else 1))
    return {"weights_gpu_gib": round(weights / GiB, 2), "model_states_gpu_gib": round(gpu / GiB, 2), "model_states_host_gib": round(host / GiB, 2),
            "activations_gib": round(act / GiB, 2), "total_gpu_gib": round((gpu + act) / GiB, 2)}


def build_plan(spec: Any, policy: Any, shape: ModelShape | None, gpu_gib: float | None,
               observations: Sequence[LO.Observation] = (), host_gib: float | None = None,
               visible_gpus: int | None = None) -> list[dict[str, Any]]:
    ctx = _context(spec, shape, gpu_gib, host_gib, visible_gpus)
    history: list[AttemptRecord] = []
    attempt_dir = Path("<attempt_dir>")
    ov, why = learn.initial_overrides(ctx, policy, observations)
    if why is None:
        steps = [{"attempt": 1, "rung": None, "reason": "the job as submitted", "changes": [],
                  "estimate": _estimate(ctx, ov, shape)}]
    else:
        pred = learn.predict(ctx, policy, observations)
        chosen = pred.chosen if pred else None
        est = _estimate(ctx, ov, shape)
        if chosen is not None:
            # The learned prediction, not the raw estimate, says whether it fits.
            est.update(_learned_numbers(chosen), fits=chosen.fits)
        r = render_attempt(spec, ov, attempt_dir=attempt_dir, resume_yaml={}, launcher=["llamafactory-cli"])
        steps = [{"attempt": 1, "rung": "learned" if ov.rungs else None, "reason": why,
                  "changes": [c.to_dict() for c in r.changes], "estimate": est}]
    for n in range(1, MAX_STEPS):
        if steps[-1]["estimate"].get("fits"):
            break
        oom = _planned_oom(ctx, steps[-1]["estimate"])
        history.append(AttemptRecord(n, ov, oom, ExitRecord(1)))
        d = decide(ctx, history, oom, policy)
        if d.kind != DecisionKind.ESCALATE or d.overrides is None:
            steps.append({"attempt": n + 1, "rung": None, "reason": f"{d.kind}: {d.reason}", "changes": [],
                          "estimate": {}})
            break
        ov = d.overrides
        r = render_attempt(spec, ov, attempt_dir=attempt_dir, resume_yaml={}, launcher=["llamafactory-cli"])
        steps.append({"attempt": n + 1, "rung": d.rung, "reason": d.reason,
                      "changes": [c.to_dict() for c in r.changes], "estimate": _estimate(ctx, ov, shape)})
    return steps


def _learned_numbers(c: learn.Candidate) -> dict[str, Any]:
    return {"learned_gpu_gib": None if c.gpu_need is None else round(c.gpu_need / GiB, 2),
            "learned_host_gib": None if c.host_need is None else round(c.host_need / GiB, 2),
            "margin": c.margin, "source": c.source}


def learned_summary(spec: Any, policy: Any, shape: ModelShape | None, gpu_gib: float | None,
                    observations: Sequence[LO.Observation], host_gib: float | None = None,
                    visible_gpus: int | None = None) -> dict[str, Any] | None:
    """The prediction, the observations it came from and the margin (None without a shape)."""
    ctx = _context(spec, shape, gpu_gib, host_gib, visible_gpus)
    pred = learn.predict(ctx, policy, observations)
    if pred is None:
        return None
    key = LO.memory_key(ctx, Overrides())
    used = {id(o) for o in (*pred.gpu.basis, *pred.host.basis, *pred.same_kind)}

    def corr(c: LE.Correction, resource: str) -> dict[str, Any]:
        return {"k": round(c.k, 3), "tier": c.tier, "raised_by_oom": c.bounded_by_oom,
                # a same-setup prediction's (learn.margin_of): the tier's and what the evidence has shown
                "margin": round(LO.MARGINS.get(c.tier, 0.0) + LE.evidence_margin(c, resource), 3) if c.tier else 0.0,
                "observations": len(c.basis)}

    obs = [{"job": o.job, "attempt": o.attempt, "tier": LE.tier_of(key, o, ctx.name), "outcome": o.outcome,
            "config": f"{o.key.get('micro_batch')}x{o.key.get('grad_accum')}",
            "cutoff_len": o.key.get("cutoff_len"), "params": o.key.get("params"),
            "gpu_peak_gib": None if o.gpu_peak is None else round(o.gpu_peak / GiB, 2),
            "host_peak_gib": None if o.host_peak is None else round(o.host_peak / GiB, 2),
            "predicted_gpu_gib": None if o.predicted_gpu is None else round(o.predicted_gpu / GiB, 2),
            "predicted_host_gib": None if o.predicted_host is None else round(o.predicted_host / GiB, 2)}
           for o in observations if id(o) in used]
    cands = sorted(pred.candidates, key=lambda c: -c.speed)
    refusal = LR.refusal_bound(ctx, policy, observations)
    return {"gpu": corr(pred.gpu, "gpu"), "host": corr(pred.host, "host"), "fit_headroom": policy.fit_headroom,
            "gpu_limit_gib": None if pred.gpu_limit is None else round(pred.gpu_limit / GiB, 2),
            "host_limit_gib": None if pred.host_limit is None else round(pred.host_limit / GiB, 2),
            "observations": obs,
            "candidates": [{"config": c.label, "fits": c.fits, "speed": round(c.speed, 3), **_learned_numbers(c)}
                           for c in cands],
            "chosen": pred.chosen.label if pred.chosen else None,
            "refused": refusal.text if refusal else None,
            # The optimistic bound a refusal was judged on, with every configuration's numbers.
            "refusal": refusal.to_dict() if refusal else None}


def _planned_oom(ctx: JobContext, est: dict[str, Any]) -> Diagnosis:
    """The OOM this configuration would die of, with the numbers the estimate predicts
    (or none, when the model size or the GPU is unknown: then the ladder is climbed plainly)."""
    if not est or not ctx.gpu_capacity_bytes:
        return Diagnosis(Category.GPU_OOM, "planned: out of memory in a training step", phase=Phase.TRAIN_STEP)
    cap = ctx.gpu_capacity_bytes
    need = int(est["total_gpu_gib"] * GiB)
    free = GiB // 4
    # The 16-bit weights are what loading puts on the GPU; the rest comes at the first step.
    phase = Phase.MODEL_LOAD if est["weights_gpu_gib"] * GiB > cap else Phase.TRAIN_STEP
    return Diagnosis(Category.GPU_OOM, f"planned: out of memory in {phase}", phase=phase,
                     numbers={"total_capacity": cap, "free": free, "tried_to_allocate": max(free, need - cap + free)})


def run(args: argparse.Namespace) -> int:
    from supervisor.intake.jobspec import JobFileError, parse_job_text

    parse_warnings: list = []
    try:
        text = args.file.read_text()
        # Relative paths resolve as `submit` resolves them: against where you run it (the job's workdir).
        spec = parse_job_text(text, source=str(args.file), submit_dir=Path.cwd(), warnings=parse_warnings)
        name = args.policy or spec.sup.policy or "default"
        policy = load_policy(name, search_dirs=[*args.policy_dir, BUILTIN_POLICY_DIR])
    except JobFileError as err:
        print(err.report(), file=sys.stderr)
        return 2
    except PolicyError as err:
        print(f"policy refused: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"cannot read {args.file}: {err}", file=sys.stderr)
        return 2
    model = spec.config.get("model_name_or_path")
    shape, model_note = _model_shape(spec, model) if isinstance(model, str) and model else (None, None)
    host_gib = getattr(args, "host_memory", None)
    gpus = _visible_gpus(spec, args.gpu_memory)
    observations = _observations(args, _context(spec, shape, args.gpu_memory, host_gib, gpus))
    steps = build_plan(spec, policy, shape, args.gpu_memory, observations, host_gib, gpus)
    learned = learned_summary(spec, policy, shape, args.gpu_memory, observations, host_gib, gpus)
    warnings = [str(w) for w in parse_warnings]
    extra = None
    if args.deepspeed_estimator and shape:
        extra = deepspeed_estimates(shape.params, shape.largest_layer_params, spec.world_size)
    if args.json:
        print(json.dumps({"job": spec.name, "policy": policy.name,
                          "params": shape.params if shape else None, "steps": steps, "warnings": warnings,
                          "deepspeed_estimates": extra, "learned": learned}, indent=2, default=str))
        return 0
    head = f"{spec.name}: policy {policy.name!r}"
    head += f", {_count(shape.params)} parameters" if shape else " (model size unknown: no memory estimates)"
    print(head)
    if model_note:
        print(model_note)
    if gpus == 0:
        print("no GPU here (none probed, none named, no --gpu-memory): planned as a run without a GPU, as the "
              "daemon on this box would run it (no offload: its 'device' is host memory)")
    for w in warnings:
        print(f"warning: {w}")
    if learned is not None:
        _print_learned(learned)
    for s in steps:
        est = s["estimate"]
        if est.get("source"):
            mem = "  [learned: " + _learned_words(est) + "]"
        else:
            mem = (f"  [GPU ~{est['total_gpu_gib']} GiB = states {est['model_states_gpu_gib']} + activations "
               f"{est['activations_gib']}; host ~{est['model_states_host_gib']} GiB"
                   + {True: "; fits", False: "; does not fit", None: ""}[est.get("fits")] + "]" if est else "")
        title = s["rung"] or ("as submitted" if s["attempt"] == 1 else "stop")
        print(f"{s['attempt']:>2}. {title}{mem}")
        if (s["rung"] is None and s["attempt"] > 1) or s["rung"] == "learned" or est.get("source"):
            print(f"    {s['reason']}")
        for c in s["changes"]:
            new = "(generated)" if c["target"] == "deepspeed" else c["new"]
            print(f"    {c['target']}.{c['key']}: {c['old']!r} -> {new!r}")
    if extra:
        for k, (g, h) in extra.items():
            print(f"DeepSpeed's own estimate, {k}: GPU {g / GiB:.1f} GiB, host {h / GiB:.1f} GiB")
    return 0


def _model_shape(spec: Any, model: str) -> tuple[ModelShape | None, str | None]:
    """The model's shape from its folder's config.json, else from the Hugging Face cache
    (the environment the job would have), else how to get that one file."""
    import os

    from supervisor.intake import facts, preflight

    local = spec.resolve(model)
    shape = read_model_shape(local)
    if shape is not None:
        return shape, None
    if local.is_dir():
        return None, f"model: {local} has no readable config.json, so no memory estimates"
    if not preflight.is_hub_id(model):
        return None, f"model: {local} does not exist here: no config.json to size the model from"
    env = {**os.environ, **spec.sup.env}
    cache = spec.config.get("cache_dir")
    cache_dir = str(spec.resolve(cache)) if isinstance(cache, str) and cache else facts.hub_cache_dir(env)
    snap = facts.hub_snapshot(model, cache_dir=cache_dir, revision=str(spec.config.get("model_revision") or "main"))
    if snap is not None:
        return read_model_shape(snap), f"model: {model}'s config.json from the Hugging Face cache ({snap})"
    return None, (f"model: {model}'s config.json is not in the Hugging Face cache ({cache_dir}); fetch that one "
                  f"file (a few KB) for memory estimates: `hf download {model} config.json` "
                  f"(or `huggingface-cli download {model} config.json`), then run plan again")


def _observations(args: argparse.Namespace, ctx: JobContext) -> list[LO.Observation]:
    """--observations FILE, else the state folder's (cli.cmd_plan sets args.state_root), else none."""
    from supervisor.record import observations as O

    path = getattr(args, "observations", None)
    root = getattr(args, "state_root", None)
    if path is None and root is not None:
        path = Path(root) / O.FILE_NAME
    if path is None or not Path(path).exists():
        return []
    try:
        with O.ObservationStore(path) as store:
            return store.similar(ctx)
    except (OSError, sqlite3.Error) as exc:  # a broken cache never stops a plan; say so
        print(f"warning: observations in {path} unreadable ({exc}); planning without them", file=sys.stderr)
        return []


def _learned_words(est: dict[str, Any]) -> str:
    parts = []
    if est.get("learned_gpu_gib") is not None:
        parts.append(f"GPU ~{est['learned_gpu_gib']} GiB")
    if est.get("learned_host_gib") is not None:
        parts.append(f"host ~{est['learned_host_gib']} GiB")
    how = "observed" if est["source"] == "observed" else f"predicted, margin {est['margin']:.0%}"
    return ", ".join(parts) + f" ({how}); " + ("fits" if est.get("fits") else "does not fit")


def _print_learned(x: dict[str, Any]) -> None:
    c = x["gpu"] if x["gpu"]["observations"] else x["host"]
    res = "GPU" if c is x["gpu"] else "host"
    if not x["observations"]:
        print("learned: no observations of a similar run; the estimator alone")
    else:
        print(f"learned: {res} estimate x{c['k']:.2f} from {c['observations']} observation(s) "
              f"({c['tier'] or 'OOM lower bounds only'}{', raised by an OOM' if c['raised_by_oom'] else ''}); "
              f"margin {c['margin']:.0%} on predictions, on top of the policy's fit_headroom "
              f"{x['fit_headroom']:.0%} (usable: " + ", ".join(
                  f"{r} {x[f'{r.lower()}_limit_gib']} GiB" for r in ("GPU", "host")
                  if x[f"{r.lower()}_limit_gib"] is not None) + ")")
        for o in x["observations"]:
            peak = o["gpu_peak_gib"] if o["gpu_peak_gib"] is not None else o["host_peak_gib"]
            pred = o["predicted_gpu_gib"] if o["gpu_peak_gib"] is not None else o["predicted_host_gib"]
            bound = ">=" if o["outcome"] != "fit" else ""
            print(f"  {o['job']} attempt {o['attempt']} ({o['tier']}): {o['config']} cutoff_len {o['cutoff_len']}: "
                  f"{o['outcome']}, peak {bound}{peak} GiB, estimator said {pred} GiB")
    if x["chosen"]:
        print(f"learned start: {x['chosen']}")
    if x["refused"]:
        print(f"refused at submit: {x['refused']}")
        r = x["refusal"]
        print(f"optimistic bound ({r['estimate']}), per configuration, against GPU "
              f"{_gib_or(r['gpu_capacity_bytes'])} and host {_gib_or(r['host_capacity_bytes'])}:")
        for b in sorted(r["configurations"], key=lambda b: (b["host"] or 0, b["gpu"] or 0)):
            print(f"  {b['label']}: GPU ~{_gib_or(b['gpu'])}{'' if b['gpu_ok'] else ' (too much)'}, "
                  f"host ~{_gib_or(b['host'])}{'' if b['host_ok'] else ' (too much)'}")


def _gib_or(n: int | None) -> str:
    return "?" if n is None else f"{n / GiB:.1f} GiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oom-supervisor plan", description=__doc__.splitlines()[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)
