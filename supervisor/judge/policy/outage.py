"""An outage of the surroundings (DNS, the Hub, a dataset host, a proxy, a read timeout, a failed
node): not the job's fault, so never the job's failure while it may still pass.

First `budgets.environment_retries` retries with the policy's exponential backoff (capped at
`backoff.max_s`); then the job WAITS, the same configuration, a try every
`budgets.environment_wait_s`, for at most `budgets.environment_wait_max_s` in all; only then does
it fail, saying what stayed down. Counted from the history alone (no clock): pure.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from supervisor.core.models import (
    AttemptRecord,
    Category,
    Decision,
    DecisionKind,
    Diagnosis,
    JobContext,
    Overrides,
)
from supervisor.judge.policy.schema import Policy

# The error that names the outage best, most precise first (a NameResolutionError is wrapped in
# a MaxRetryError inside a ConnectionError: the innermost says what happened).
_ERRORS = (
    ("NameResolutionError", "NameResolutionError"), ("Temporary failure in name resolution", "NameResolutionError"),
    ("Name or service not known", "NameResolutionError"), ("Failed to resolve", "NameResolutionError"),
    ("ProxyError", "ProxyError"), ("SSLError", "SSLError"), ("ReadTimeoutError", "ReadTimeoutError"),
    ("ReadTimeout", "ReadTimeout"), ("ConnectTimeoutError", "ConnectTimeoutError"),
    ("ConnectionResetError", "ConnectionResetError"), ("Connection aborted", "connection aborted"),
    ("Network is unreachable", "network unreachable"), ("MaxRetryError", "MaxRetryError"),
    ("ConnectionError", "ConnectionError"),
)
_HTTP_5XX = re.compile(r"\b(50[234])\b (?:Server Error|Service Unavailable|Bad Gateway|Gateway Time-?out)"
                       r"|HTTP Error (50[234])")
_HOST = re.compile(r"host='([^']+)'|Failed to resolve '([^']+)'|couldn't connect to '?https?://([^/'\s:]+)"
                   r"|https?://([A-Za-z0-9.-]+\.[A-Za-z]{2,})")


def outage_words(d: Diagnosis) -> str:
    """'huggingface.co unreachable (NameResolutionError)', from the evidence and the summary."""
    if d.subkind == "node_fail":
        return "the node failed"
    text = " ".join([*(e.text for e in d.evidence), d.summary])
    err = next((name for needle, name in _ERRORS if needle in text), None)
    http = _HTTP_5XX.search(text)
    if http:
        err = f"HTTP {http.group(1) or http.group(2)}"
    m = _HOST.search(text)
    host = next((g for g in m.groups() if g), None) if m else None
    if host:
        return f"{host} unreachable" + (f" ({err})" if err else "")
    return "the network failed" + (f" ({err})" if err else "")


def _dur(s: float) -> str:
    s = round(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def decide_environment(job: JobContext, history: Sequence[AttemptRecord], diagnosis: Diagnosis, policy: Policy,
                       current: Overrides, retry: Callable[[JobContext, Overrides, Policy, int, str], Decision]
                       ) -> Decision:
    """Retry with backoff, then wait, then fail; `retry` is decide's own (the backoff)."""
    b = policy.budgets
    n = sum(1 for a in history if a.diagnosis is not None and a.diagnosis.category == Category.ENVIRONMENT)
    what = outage_words(diagnosis)
    if n <= b.environment_retries:
        return retry(job, current, policy, n, f"environment failure ({what}): the hub, DNS or network, not the "
                                              f"job; retry {n} of {b.environment_retries} with backoff")
    waiting_for = "a healthy node" if diagnosis.subkind == "node_fail" else "the network"
    waited = min((n - b.environment_retries - 1) * b.environment_wait_s, b.environment_wait_max_s)
    left = b.environment_wait_max_s - waited
    if left > 0:
        delay = min(b.environment_wait_s, left)
        return Decision(DecisionKind.WAIT, (
            f"waiting for {waiting_for}: {what} in {n} attempts; next try in {_dur(delay)}; "
            f"{_dur(waited + delay)} of at most {_dur(b.environment_wait_max_s)} waited by then "
            f"(environment_wait_max_s), after {b.environment_retries} retries with backoff: the outage is not "
            "the job's fault, so the job is not failed"),
            delay_s=delay, overrides=current)
    gone = "the network stayed down" if waiting_for == "the network" else "no healthy node came"
    return Decision(DecisionKind.FAIL, f"{gone}: {what} in {n} attempts, after {b.environment_retries} retries "
                                       f"with backoff and {_dur(waited)} of waiting (environment_wait_max_s "
                                       f"{_dur(b.environment_wait_max_s)}): {diagnosis.summary}")
