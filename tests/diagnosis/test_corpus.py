"""The unseen-log corpus (bench/corpus) is what the README's held-out figure stands on: every
excerpt is a real log with its source, the split is by thread and keeps its share held out."""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from supervisor.core.models import Category

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "bench" / "corpus"
sys.path.insert(0, str(REPO / "bench"))
from bench_classifier import HELDOUT_PERCENT, part_of  # noqa: E402 - bench/ is not a package

SIDECARS = sorted(CORPUS.rglob("*.expect.yaml"))
THREAD_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+#\d+$")
LABELS = {c.value for c in Category}


def test_the_corpus_is_there():
    assert len(SIDECARS) >= 100


@pytest.mark.parametrize("sidecar", SIDECARS, ids=lambda p: p.name.replace(".expect.yaml", ""))
def test_every_excerpt_is_real_labeled_and_sourced(sidecar):
    side = yaml.safe_load(sidecar.read_text())
    assert THREAD_RE.match(side.get("thread", "")), f"{sidecar.name}: thread must be owner/repo#N"
    owner_repo, number = side["thread"].split("#")
    assert side.get("source", "").lower().startswith(f"https://github.com/{owner_repo}/".lower())
    assert side["source"].rstrip("/").endswith(f"/{number}") or f"/{number}#" in side["source"]
    assert side["expect"]["category"] in LABELS
    log = sidecar.with_name(sidecar.name.replace(".expect.yaml", ".log"))
    assert log.read_bytes().strip(), f"{log.name} is empty"


def test_a_thread_gives_at_most_three_excerpts_and_the_split_keeps_them_together():
    threads = Counter(yaml.safe_load(s.read_text())["thread"].lower() for s in SIDECARS)
    assert max(threads.values()) <= 3
    assert part_of("Owner/Repo#1") == part_of("owner/repo#1")


def test_at_least_thirty_percent_is_held_out():
    parts = Counter(part_of(yaml.safe_load(s.read_text())["thread"]) for s in SIDECARS)
    assert parts["heldout"] / len(SIDECARS) >= 0.30, parts
    assert HELDOUT_PERCENT >= 30


WATCHDOG = {"returncode": -9, "signal": "SIGKILL", "stopped_by": "hang"}


def test_a_hang_is_scored_with_the_watchdogs_record_and_nothing_else_carries_a_stop():
    """A log that just stops says nothing a reader can act on: the daemon decides a hang from no
    progress over time and writes that into the exit record. The corpus gives hang excerpts that
    record (the input the diagnosis really has) and no other excerpt a stop of the daemon's (an exit
    status its thread showed is fine), so the record never becomes a hint that the label chose."""
    for sidecar in SIDECARS:
        side = yaml.safe_load(sidecar.read_text())
        if side["expect"]["category"] == "hang":
            assert side.get("exit") == WATCHDOG, sidecar.name
        else:
            assert "stopped_by" not in (side.get("exit") or {}), sidecar.name
