"""The nodes of a multi-node attempt, judged together (pure).

Every node's launch shim writes its own exit record (`exit-<node>.json`), so one node's failure
can never be overwritten by, or hide behind, another's success. Here they become the one exit
record the classifier takes, and the diagnosis says which node (and rank) failed:

- any node that did not exit 0 makes the attempt a failure; of several, the one that failed on
  its own comes first (a node ended by SIGTERM was stopped, by us or by Slurm, because another
  failed), then the earliest to end;
- all nodes at 0 but one expected node without a record: not a success (that node's end is
  unknown; the scheduler's verdict decides);
- a rank named by the log is placed on its node by arithmetic: torchrun gives node k the ranks
  k*nproc .. k*nproc + nproc-1, and NODE_RANK is the node's SLURM_NODEID (its index in the job's
  node list).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from supervisor.core.models import Category, Diagnosis, Evidence

_STOPPED = ("SIGTERM", "SIGINT", "SIGHUP")
_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(spec: str | None) -> list[str]:
    """Slurm's compact host list ('node[1-2,5]', 'a,b', 'gpu[01-03]x') as names, in order."""
    if not spec:
        return []
    out: list[str] = []
    for part in _split_top(spec):
        m = re.match(r"^(.*?)\[([^\]]*)\](.*)$", part)
        if not m:
            out.append(part)
            continue
        head, body, tail = m.groups()
        for piece in body.split(","):
            r = _RANGE_RE.match(piece.strip())
            if not r:
                out.append(f"{head}{piece}{tail}")
                continue
            lo, hi = r.group(1), r.group(2) or r.group(1)
            width = len(lo) if lo.startswith("0") else 0
            for i in range(int(lo), int(hi) + 1):
                out.extend(expand_nodelist(f"{head}{str(i).zfill(width)}{tail}"))
    return out


def _split_top(spec: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in spec:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def _failed(r: Mapping[str, Any]) -> bool:
    return r.get("returncode") != 0


def _brief(r: Mapping[str, Any]) -> dict[str, Any]:
    return {k: r.get(k) for k in ("returncode", "signal", "ended_at", "node_rank", "launch_error") if r.get(k) is not None}


def combine_exits(records: Mapping[str, Mapping[str, Any]], expected: Sequence[str] = ()) -> dict[str, Any] | None:
    """One exit record for the attempt from every node's (`{node: record}`; "" for a single
    `exit.json`), with `node` (the one that decided), `nodes` (each node's end) and
    `missing_nodes` (expected nodes that wrote nothing). None when no node wrote one."""
    if not records:
        return None
    missing = [n for n in expected if n not in records]
    if len(records) == 1 and not missing:
        ((node, only),) = records.items()
        return {**only, **({"node": node} if node else {})}
    nodes = {n: _brief(r) for n, r in sorted(records.items())}
    failures = [(n, r) for n, r in records.items() if _failed(r)]
    started = [r["started_at"] for r in records.values() if r.get("started_at")]
    peak = max((int(r.get("peak_rss_bytes") or 0) for r in records.values()), default=0)
    if failures:
        node, chosen = min(failures, key=lambda nr: (nr[1].get("signal") in _STOPPED,
                                                      nr[1].get("ended_at") or float("inf"), nr[0]))
        out = {**chosen, "node": node}
    elif missing:
        ended = max((r.get("ended_at") or 0 for r in records.values()), default=0) or None
        out = {"returncode": None, "signal": None, "ended_at": ended,
               "note": f"node(s) {', '.join(missing)} left no exit record while "
                       f"{', '.join(sorted(records))} exited 0: their end is unknown, not a success"}
    else:  # every node exited 0: no node decided it
        _, chosen = max(records.items(), key=lambda nr: (nr[1].get("ended_at") or 0, nr[0]))
        out = {k: v for k, v in chosen.items() if k not in ("node", "node_rank", "pid")}
    out.update(nodes=nodes, missing_nodes=missing)
    if started:
        out["started_at"] = min(started)
    if peak:
        out["peak_rss_bytes"] = peak
    return out


def node_of_rank(rank: int | None, nproc_per_node: int | None, nodes: Sequence[str]) -> str | None:
    """The node that ran global `rank` (torchrun: node k holds ranks k*nproc .. k*nproc+nproc-1)."""
    if rank is None or not nproc_per_node or not nodes or rank < 0:
        return None
    k = rank // nproc_per_node
    return nodes[k] if k < len(nodes) else None


def locate(diagnosis: Diagnosis, *, exit_node: str | None, rank_node: str | None,
           failed_nodes: Sequence[str] = (), scheduler_words: Sequence[str] = (),
           node_ends: Mapping[str, Mapping[str, Any]] | None = None) -> Diagnosis:
    """The diagnosis with the node it happened on and the scheduler's own words as evidence.

    `failed_nodes`: nodes the scheduler reports down (a node failure names them, never the log's
    last lines); `rank_node`: the node of the rank the log named; `exit_node`: the node whose exit
    record decided. The first known of these is the node; a disagreement is said, not hidden."""
    node = (failed_nodes[0] if failed_nodes else None) or rank_node or exit_node
    if diagnosis.category is Category.SUCCESS:
        node = None  # every node exited 0: none to name
    said: list[str] = []
    if failed_nodes:
        said.append(f"Slurm reports node(s) {', '.join(failed_nodes)} down")
    elif node is not None:
        where = f"on node {node}"
        if diagnosis.rank is not None and rank_node is not None:
            where += f" (rank {diagnosis.rank})"
        said.append(where[0].upper() + where[1:])
        if rank_node is not None and exit_node is not None and exit_node != rank_node:
            said.append(f"The first node to fail by its exit record was {exit_node}")
    if node_ends and len(node_ends) > 1:
        said.append("Nodes: " + "; ".join(f"{n} {_end_words(e)}" for n, e in sorted(node_ends.items())))
    evidence = diagnosis.evidence
    if scheduler_words and diagnosis.numbers.get("scheduler_state"):
        # The scheduler decided: its own words are the evidence, not the log's last lines.
        evidence = tuple(Evidence(line_no=0, text=w[:500], rule="scheduler") for w in scheduler_words) + tuple(
            e for e in evidence if e.rule != "tail")
    head = diagnosis.summary.rstrip()
    if said and head and head[-1] not in ".!?":
        head += "."
    summary = head + (" " + ". ".join(said) + "." if said else "")
    return dataclasses.replace(diagnosis, node=node, summary=summary, evidence=evidence[:8])


def _end_words(e: Mapping[str, Any]) -> str:
    if e.get("signal"):
        return f"killed by {e['signal']}"
    if e.get("returncode") is None:
        return "no exit record"
    return f"exit {e['returncode']}"
