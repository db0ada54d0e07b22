"""The escalation policy: choose the next attempt's configuration, render it.

Pure modules: schema (parsing aside), rungs, decide, render, estimate (except
`read_model_shape`), allocator. `plan` is the CLI edge.
"""

from supervisor.judge.policy.decide import backoff_delay, decide
from supervisor.judge.policy.render import RenderedAttempt, check_rendered, render_attempt
from supervisor.judge.policy.schema import (
           BUILTIN_POLICY_DIR,
           Policy,
           PolicyError,
           load_policy,
           parse_policy_text,
)

__all__ = ["BUILTIN_POLICY_DIR", "Policy", "PolicyError", "RenderedAttempt", "backoff_delay", "check_rendered", "decide",
           "load_policy", "parse_policy_text", "render_attempt"]
