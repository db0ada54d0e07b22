"""Issue 29: an outage of the surroundings (DNS, the Hub, a proxy) is not the job's fault. It is
retried with a capped exponential backoff, then the job WAITS (longer, bounded intervals) and
says why; it fails only when the total wait is spent."""

from __future__ import annotations

import re

from supervisor.core.models import Category, DecisionKind, Diagnosis, ExitRecord, Overrides
from supervisor.judge.diagnosis import diagnose_file
from supervisor.judge.policy import decide
from supervisor.judge.policy.outage import outage_words
from tests.diagnosis.cases import FIXTURES

from .builders import attempt, job

HUB_LOG = FIXTURES / "environment_hub_connection_error.log"


def hub_down() -> Diagnosis:
    """The diagnosis of a real log: a Hub lookup that failed for want of DNS."""
    d = diagnose_file(HUB_LOG, ExitRecord(1), None)
    assert d.category == Category.ENVIRONMENT
    return d


def tiny(policy, **budgets):
    """The shipped policy with small numbers: retries 2, waits of 60 s up to 150 s in all."""
    b = policy.budgets.model_copy(update={"environment_retries": 2, "environment_wait_s": 60.0,
                                          "environment_wait_max_s": 150.0, **budgets})
    return policy.model_copy(update={"budgets": b})


def run(policy, n: int, d: Diagnosis | None = None):
    d = d or hub_down()
    hist = [attempt(i, Overrides(), d) for i in range(1, n + 1)]
    return decide(job(max_attempts=3), hist, d, policy)


def test_the_outage_is_named_from_the_log():
    assert outage_words(hub_down()) == "huggingface.co unreachable (NameResolutionError)"
    assert outage_words(Diagnosis(Category.ENVIRONMENT, "x", subkind="network")) == "the network failed"


def test_first_tries_are_retries_with_a_growing_capped_backoff_said_in_seconds(default_policy):
    p = tiny(default_policy)
    first, second = run(p, 1), run(p, 2)
    assert first.kind == second.kind == DecisionKind.RETRY
    assert 0 < first.delay_s < second.delay_s <= p.backoff.max_s
    assert f"waiting {second.delay_s:.0f} s" in second.reason
    assert "huggingface.co unreachable (NameResolutionError)" in first.reason and "retry 2 of 2" in second.reason


def test_after_the_retries_the_job_waits_and_says_why_instead_of_failing(default_policy):
    p = tiny(default_policy)
    d = run(p, 3)  # retries spent; the old code failed the job here
    assert d.kind == DecisionKind.WAIT, d.reason
    assert d.delay_s == 60.0
    assert d.reason.startswith("waiting for the network: huggingface.co unreachable (NameResolutionError) "
                               "in 3 attempts")
    assert d.overrides == Overrides()  # the job unchanged


def test_the_wait_is_bounded_in_total_then_the_job_fails_with_the_reason(default_policy):
    p = tiny(default_policy)
    assert run(p, 4).kind == DecisionKind.WAIT and run(p, 4).delay_s == 60.0
    last = run(p, 5)
    assert last.kind == DecisionKind.WAIT and last.delay_s == 30.0  # what is left of the 150 s
    fail = run(p, 6)
    assert fail.kind == DecisionKind.FAIL
    assert re.search(r"network.*huggingface\.co unreachable \(NameResolutionError\) in 6 attempts", fail.reason)
    assert "2m30s" in fail.reason and "environment_wait_max_s" in fail.reason


def test_the_shipped_default_waits_minutes_between_tries_for_hours(default_policy):
    b = default_policy.budgets
    assert 600 <= b.environment_wait_s <= 900 and 2 * 3600 <= b.environment_wait_max_s <= 12 * 3600
    d = run(default_policy, b.environment_retries + 1)
    assert d.kind == DecisionKind.WAIT and d.delay_s == b.environment_wait_s


def test_an_outage_is_not_held_to_the_attempt_budget(default_policy):
    """max_attempts counts the job's own failures; waiting out an outage is not one."""
    assert run(tiny(default_policy), 3).kind == DecisionKind.WAIT  # job(max_attempts=3), 3 attempts


def test_a_failed_node_waits_for_a_node_not_for_the_network(default_policy):
    node = Diagnosis(Category.ENVIRONMENT, "the node failed", subkind="node_fail")
    d = run(tiny(default_policy), 3, node)
    assert d.kind == DecisionKind.WAIT and d.reason.startswith("waiting for a healthy node: ")


def test_unknown_never_triggers_a_remedy(default_policy):
    """`unknown` says nothing about memory: the same configuration again, never a rung."""
    u = Diagnosis(Category.UNKNOWN, "no failure evidence", fingerprint="unknown:x")
    for n in range(1, 6):
        hist = [attempt(i, Overrides(), Diagnosis(Category.UNKNOWN, "x", fingerprint=f"u{i}"))
                for i in range(1, n)] + [attempt(n, Overrides(), u)]
        d = decide(job(max_attempts=10), hist, u, default_policy)
        assert d.kind in (DecisionKind.RETRY, DecisionKind.FAIL), d
        assert d.rung is None and not d.changes


def test_waiting_out_an_outage_spends_none_of_the_jobs_own_budgets(default_policy):
    """After a night of waiting for the network, the job's first crash of its own is retried: the
    outage counted toward neither the attempt budget nor the no-progress run."""
    p = tiny(default_policy)
    crash = Diagnosis(Category.CRASH_OTHER, "Segmentation fault", fingerprint="crash_other:segfault")
    hist = [attempt(i, Overrides(), hub_down()) for i in range(1, 6)] + [attempt(6, Overrides(), crash)]
    d = decide(job(max_attempts=3), hist, crash, p)
    assert d.kind == DecisionKind.RETRY, d.reason
