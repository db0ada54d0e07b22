"""Every labeled fixture log is classified as its sidecar says, however it is chunked."""

from __future__ import annotations

import random

import pytest

from supervisor.judge.diagnosis import LogScanner, diagnose_bytes
from tests.diagnosis.cases import fixture_cases, load_case

CASES = fixture_cases()

# Real logs (tests/fixtures/logs/real/, copied from public issues) whose label the log alone cannot
# give without rules written for that one text. Each is a strict xfail: fixing it flags here.
KNOWN_MISSES = {
    "config_flame_hf_offline_env_couldnt_connect": (
        "transformers' 'We couldn't connect ... not the path to a directory' is raised for a down network and"
        " for an offline box alike; without HF_HUB_OFFLINE in the log it stays environment (a retry)"),
    "device_fault_ecc_nccl_watchdog_kohya_2xh100": (
        "rank: the unprefixed traceback and the [Rank 1] watchdog line cannot be tied to one process"),
    "device_fault_thcudacheck_launch_failure_tmux_border": "phase: only the frames AFTER the error say train",
    "disk_full_tf_save_weights_chained_fallback": "phase: only the cut chained traceback after it says save",
    "gpu_oom_ray_taskerror_verl_update_actor": "phase: verl's update_actor is not a frame name we know",
    "host_oom_flag_ogbn_products_60gb_backticks": "phase: a one-line paste; the issue text says evaluation",
}


def _ids(p):
    return p.name.replace(".expect.yaml", "")


def _case_param(p):
    why = KNOWN_MISSES.get(_ids(p))
    return pytest.param(p, id=_ids(p), marks=pytest.mark.xfail(reason=why, strict=True) if why else ())


LABELED = [_case_param(p) for p in CASES]


def test_fixture_set_covers_every_category():
    seen = {load_case(c)[1]["expect"]["category"] for c in CASES}
    assert seen == {
        "gpu_oom", "host_oom", "comm_failure", "hang", "config_error", "disk_full",
        "numeric", "device_fault", "crash_other", "success", "unknown", "environment",
    }
    vendors = {load_case(c)[1]["expect"].get("vendor") for c in CASES}
    assert {"hip", "cuda", "cpu"} <= vendors


@pytest.mark.parametrize("case", LABELED)
def test_fixture_is_classified_as_labeled(case):
    log, side, exit, host = load_case(case)
    want = side["expect"]
    scanner = LogScanner()
    fatal = scanner.feed(log)
    d = scanner.finish(exit, host)
    got = d.to_dict()
    assert got["category"] == want["category"], d.summary
    for key in ("subkind", "vendor", "phase", "rank", "fragmentation", "strength"):
        if key in want:
            assert got[key] == want[key], f"{key}: {got[key]!r} != {want[key]!r} ({d.summary})"
    for key, value in (want.get("numbers") or {}).items():
        assert got["numbers"].get(key) == value, f"numbers[{key}] = {got['numbers'].get(key)!r}, want {value!r}"
    if "evidence_rule" in want:
        assert got["evidence"] and got["evidence"][0]["rule"] == want["evidence_rule"], got["evidence"]
    if "evidence_line" in want:
        assert got["evidence"][0]["line_no"] == want["evidence_line"], got["evidence"][0]
        assert log.split(b"\n")[want["evidence_line"] - 1].strip(), "evidence line must exist in the file"
    for rule in want.get("also_evidence_rules", ()):
        assert rule in {e["rule"] for e in got["evidence"]}, got["evidence"]
    for rule in want.get("no_evidence_rules", ()):
        assert rule not in {e["rule"] for e in got["evidence"]}
    if "likely" in want:  # an `unknown`'s "why not": the category named first as where to look
        assert got["candidates"] and got["candidates"][0]["category"] == want["likely"], got["candidates"]
    for text in want.get("summary_contains", ()):
        assert text in d.summary, d.summary
    if "last_step" in want:
        assert scanner.last_step == want["last_step"]
    if "fatal_rules" in side:
        assert sorted({e.rule for e in fatal}) == sorted(side["fatal_rules"]), fatal
    assert scanner.lines_seen == log.count(b"\n") + (0 if log.endswith(b"\n") or not log else 1)


def test_every_real_fixture_names_its_source():
    real = [c for c in CASES if c.parent.name == "real"]
    assert len(real) >= 100
    for c in real:
        _log, side, _exit, _host = load_case(c)
        assert str(side.get("source", "")).startswith("https://"), c.name


def test_known_misses_are_real_fixtures():
    names = {_ids(c) for c in CASES}
    assert set(KNOWN_MISSES) <= names


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_fixture_diagnosis_does_not_depend_on_chunking(case):
    log, side, exit, host = load_case(case)
    whole = diagnose_bytes(log, exit, host).to_dict()
    rng = random.Random(case.name)
    scanner = LogScanner()
    fatal_rules = []
    i = 0
    while i < len(log):
        n = rng.choice((1, 2, 3, 7, 64, 500, 4096))
        fatal_rules += [e.rule for e in scanner.feed(log[i : i + n])]
        i += n
    assert scanner.finish(exit, host).to_dict() == whole
    if "fatal_rules" in side:
        assert sorted(set(fatal_rules)) == sorted(side["fatal_rules"])
