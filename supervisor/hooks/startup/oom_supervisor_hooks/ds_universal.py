"""Correct DeepSpeed 0.19's ZeRO-3 universal checkpoint load (OOM_SUPERVISOR_DS_UNIVERSAL_FIX=1).

`DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3` (measured on
DeepSpeed 0.19.8, tests/checkpoints/test_real_world_size.py):
  * gives every parameter sub-group ONE shared `step` tensor: torch's fused AdamW increments it
    in place once per group, so after a universal load Adam's step counter advances by the number
    of groups per step (HF makes two: decay / no decay) and the bias correction drifts;
  * copies param group 0's hyper-parameters into every group: the no-decay group (biases, norms)
    gets group 0's weight decay.
After the original load, each state gets its own copy of the step and every group its own weight
decay back, as the trainer created it. Nothing else is touched; on any other DeepSpeed the method
is wrapped the same way and the fix is a no-op where there is nothing to fix.
"""

import os

from . import TRACE_ENV, warn

ENV = "OOM_SUPERVISOR_DS_UNIVERSAL_FIX"
_METHOD = "load_hp_checkpoint_state_from_checkpoint_dir_stage3"


def install(stage3):
    cls = getattr(stage3, "DeepSpeedZeroOptimizer_Stage3", None)
    original = getattr(cls, _METHOD, None) if cls is not None else None
    if original is None or getattr(original, "_oom_supervisor", False):
        return

    def load(self, *args, **kwargs):
        groups = getattr(getattr(self, "optimizer", None), "param_groups", None) or []
        decay = [g.get("weight_decay") for g in groups]
        result = original(self, *args, **kwargs)
        try:
            fixed = _fix(self.optimizer, decay)
        except Exception as exc:  # noqa: BLE001 - inside the user's training: never break it over the fix, say so instead
            warn(f"could not correct the universal load: {exc!r}")
            return result
        _trace(fixed)
        return result

    load._oom_supervisor = True
    load.__name__ = _METHOD
    setattr(cls, _METHOD, load)


def _fix(optimizer, decay):
    steps = 0
    shared = {}
    for state in optimizer.state.values():
        step = state.get("step")
        if step is not None and hasattr(step, "clone"):
            shared[id(step)] = shared.get(id(step), 0) + 1
    for state in optimizer.state.values():
        step = state.get("step")
        if step is not None and hasattr(step, "clone") and shared.get(id(step), 0) > 1:
            state["step"] = step.clone()
            steps += 1
    groups = 0
    for group, wd in zip(optimizer.param_groups, decay):
        if wd is not None and group.get("weight_decay") != wd:
            group["weight_decay"] = wd
            groups += 1
    return steps, groups


def _trace(fixed):
    steps, groups = fixed
    warn(f"universal checkpoint load corrected: {steps} shared step counters split, {groups} param groups' "
         "weight decay restored")
    trace = os.environ.get(TRACE_ENV)
    if trace:
        try:
            with open(trace, "a") as fh:
                fh.write(f"{os.getpid()} ds_universal steps={steps} groups={groups}\n")
        except OSError:
            pass
