"""render_attempt(): turn (job, overrides) into argv, environment and file contents.

Pure: it returns what to write; the daemon writes `files` into the attempt
folder and runs `argv` with cwd = spec.workdir, so relative paths in the
user's config keep meaning what they meant.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from supervisor import PACKAGE_DIR
from supervisor.core.models import Change, Overrides, Problem
from supervisor.intake.deepspeed_config import check_launch_pair
from supervisor.intake.jobspec import JobSpec
from supervisor.intake.llamafactory.validate import lf_fields
from supervisor.judge.policy.allocator import ALLOC_VARS, merged_alloc_env
from supervisor.judge.policy.rungs import MEMORY_FRACTION_ENV

HOOK_DIR = PACKAGE_DIR / "hooks" / "startup"
# Read by the start-up hook (hooks/startup, emergency.py): "1" on (the default), "0" off. A job
# turns it off with `supervisor.env: {OOM_SUPERVISOR_EMERGENCY_CKPT: "0"}`, a policy through
# Overrides.env with the same value.
EMERGENCY_CKPT_ENV = "OOM_SUPERVISOR_EMERGENCY_CKPT"
# Read by the start-up hook (replica.py): the seconds a multi-rank emergency save may take.
EMERGENCY_BUDGET_ENV = "OOM_SUPERVISOR_EMERGENCY_BUDGET_S"
# Read by the start-up hook (ds_universal.py): "1" corrects DeepSpeed's ZeRO-3 universal load.
DS_UNIVERSAL_FIX_ENV = "OOM_SUPERVISOR_DS_UNIVERSAL_FIX"
EFFECTIVE_YAML = "effective.yaml"
DS_CONFIG = "ds_config.json"

_WHY = {
    "overwrite_output_dir": "must be false so the run resumes from its checkpoints "
                            "(true disables resume and deletes trainer_log.jsonl)",
    "deepspeed": "points at the generated DeepSpeed config in the attempt folder",
    "resume_from_checkpoint": "resume from the last complete checkpoint",
    EMERGENCY_CKPT_ENV: "start-up hook: a catchable OOM in a one-process Trainer run saves a checkpoint of "
                        "the last finished step before the process exits (training itself unchanged)",
    EMERGENCY_BUDGET_ENV: "start-up hook: the policy's emergency_budget_s, the most a multi-rank (DDP replica) "
                          "emergency save may take before the rank gives up and exits",
    "PYTHONPATH": "puts the supervisor's start-up hook (a sitecustomize) first",
    "PATH": "LLaMA-Factory's launcher runs torchrun (several GPUs, FORCE_TORCHRUN) from PATH: the launcher's own "
            "bin directory first, as an activated venv has it (the rest of PATH follows)",
    DS_UNIVERSAL_FIX_ENV: "start-up hook: after DeepSpeed's ZeRO-3 universal load, each state gets its own Adam "
                          "step counter and each param group its own weight decay (DeepSpeed 0.19 shares one "
                          "step tensor and copies group 0's settings); the resume is then exact",
}


@dataclass(frozen=True)
class RenderedAttempt:
    argv: list[str]
    env: dict[str, str]  # only what this attempt sets
    files: dict[str, str] = field(default_factory=dict)  # name in attempt_dir -> content
    changes: list[Change] = field(default_factory=list)  # against the user's original

    def to_dict(self) -> dict[str, Any]:
        return {"argv": self.argv, "env": self.env, "files": sorted(self.files),
                "changes": [c.to_dict() for c in self.changes]}


def _why(overrides: Overrides, key: str) -> str:
    if key in _WHY:
        return _WHY[key]
    for note in reversed(overrides.notes):
        if key in note:
            return note
    return "set by " + ", ".join(overrides.rungs) if overrides.rungs else "set by the supervisor"


def _coerce_floats(config: Mapping[str, Any]) -> dict[str, Any]:
    """PyYAML reads `1e-5` as a string, LLaMA-Factory's OmegaConf as a float: write the float."""
    fields = lf_fields("builtin")
    out = dict(config)
    for k, v in config.items():
        spec = fields.get(k)
        if isinstance(v, str) and spec and "float" in spec["types"] and "str" not in spec["types"]:
            try:
                out[k] = float(v)
            except ValueError:
                pass
    return out


def render_env(spec: JobSpec, overrides: Overrides) -> dict[str, str]:
    env = {k: v for k, v in overrides.env.items() if k not in ALLOC_VARS}
    ours = overrides.env.get(ALLOC_VARS[0])
    if ours:
        from supervisor.judge.policy.allocator import parse_alloc_conf

        env.update(merged_alloc_env(spec.sup.env, parse_alloc_conf(ours)))
    emergency = "0" not in (spec.sup.env.get(EMERGENCY_CKPT_ENV), overrides.env.get(EMERGENCY_CKPT_ENV))
    if emergency:
        env[EMERGENCY_CKPT_ENV] = "1"
    if MEMORY_FRACTION_ENV in overrides.env or emergency or env.get(DS_UNIVERSAL_FIX_ENV) == "1":
        existing = spec.sup.env.get("PYTHONPATH")
        env["PYTHONPATH"] = str(HOOK_DIR) + (f":{existing}" if existing else "")
    return env


def check_rendered(rendered: RenderedAttempt, *, user_deepspeed: Mapping[str, Any] | None,
                   world_size: int) -> list[Problem]:
    """Before launch: the rendered YAML and the DeepSpeed JSON it will load (the attempt's own
    ds_config.json, else the user's), matched as transformers will (`check_launch_pair`).
    Call it after every edit of `rendered.files` (resume keys merged into the JSON)."""
    if EFFECTIVE_YAML not in rendered.files:
        return []
    effective = yaml.safe_load(rendered.files[EFFECTIVE_YAML]) or {}
    ds = json.loads(rendered.files[DS_CONFIG]) if DS_CONFIG in rendered.files else user_deepspeed
    return check_launch_pair(effective, ds, world_size=world_size)


def render_attempt(spec: JobSpec, overrides: Overrides, *, attempt_dir: Path,
                   resume_yaml: Mapping[str, Any], launcher: Sequence[str]) -> RenderedAttempt:
    env = render_env(spec, overrides)
    changes = [Change("env", k, spec.sup.env.get(k), v, _why(overrides, k)) for k, v in sorted(env.items())
               if spec.sup.env.get(k) != v]
    if spec.kind == "command":
        return RenderedAttempt(argv=list(spec.sup.command or []), env=env, changes=changes)

    launcher_bin = _launcher_bin(launcher)
    if launcher_bin and "PATH" not in spec.sup.env and "PATH" not in env:
        env["PATH"] = launcher_bin  # first; compose_environment puts the inherited PATH after it
        changes.append(Change("env", "PATH", None, f"{launcher_bin}:$PATH", _WHY["PATH"]))
    original = dict(spec.config)
    effective = _coerce_floats(original)
    effective.update(overrides.yaml)
    effective["overwrite_output_dir"] = False
    files: dict[str, str] = {}
    if overrides.deepspeed is not None:
        files[DS_CONFIG] = json.dumps(overrides.deepspeed, indent=2) + "\n"
        effective["deepspeed"] = str(attempt_dir / DS_CONFIG)
    effective.update(resume_yaml)
    files[EFFECTIVE_YAML] = yaml.safe_dump(effective, sort_keys=False, allow_unicode=True)
    for key, new in effective.items():
        old = original.get(key)
        if key not in original or old != new:
            if key in original and isinstance(old, str) and isinstance(new, float) and key not in overrides.yaml:
                continue  # the same number, written as a float
            changes.append(Change("yaml", key, old, new, _why(overrides, key)))
    if overrides.deepspeed is not None:
        changes.append(Change("deepspeed", DS_CONFIG, original.get("deepspeed"), overrides.deepspeed,
                              _why(overrides, "DeepSpeed")))
    argv = [*launcher, "train", str(attempt_dir / EFFECTIVE_YAML)]
    return RenderedAttempt(argv=argv, env=env, files=files, changes=changes)


def _launcher_bin(launcher: Sequence[str]) -> str | None:
    """The directory of a launcher named by its path (`/opt/lf/bin/llamafactory-cli`): its torchrun
    is beside it, not necessarily on the daemon's PATH (systemd's is /usr/bin:/bin). A bare name
    was found on PATH, and so is its torchrun."""
    first = Path(launcher[0]) if launcher else None
    return str(first.parent) if first is not None and first.is_absolute() else None
