"""Slurm backend: one attempt is one `sbatch` job; the daemon follows it through Slurm's own words.

API (what the attempt runner calls; every Slurm command runs with a timeout, none imports torch):

- ``submit(attempt_dir, log, argv, cwd, env, *, settings, request, job_name) -> SlurmSubmission``
  writes ``attempt_dir/slurm_batch.sh`` (which ``exec``s the launcher, so Slurm's SIGTERM reaches
  the trainer and not a shell that would swallow it) and runs ``sbatch --parsable`` with the
  attempt's environment as sbatch's own (``--export=ALL``). The log is the job's ``--output``,
  opened with ``--open-mode=append`` (a requeue must not truncate what the scanner already read).
  ``--no-requeue``: on a node failure or preemption Slurm would rerun this attempt's rendered
  config (old resume point, old remedies) by itself; the attempt ends NODE_FAIL/PREEMPTED instead
  and the daemon plans the next one. Slurm rounds time limits up to whole minutes.
- ``query(job_id) -> SlurmJobState | None``: ``scontrol -d show job J --oneliner``, then
  ``sacct -c`` (the jobcomp file) once scontrol has forgotten the job (MinJobAge); None when
  neither knows it (lost). Raises SlurmUnavailable when the controller does not answer within
  ``timeout_s`` (keep the attempt, ask again later), SlurmError for other failures.
- ``query_many(job_ids) -> dict[str, SlurmJobState]``: one ``squeue`` call for every followed
  job (no exit codes: call ``query`` for the ones that turned terminal); cached for
  ``POLL_INTERVAL_S`` so a loop polling many attempts costs one RPC per interval.
- ``find_by_name(job_name) -> dict[str, SlurmJobState]``: before resubmitting after a submit
  that raised SlurmUnavailable (the job may exist although sbatch's answer was lost).
- ``cancel(job_id, *, hard, kill_now, steps_only) -> commands``: soft sends SIGTERM to the shims
  (the exec'd batch process on one node; the srun step's tasks on several, never srun itself);
  hard is ``scancel`` (SIGTERM, KillWait, SIGKILL); ``kill_now`` is ``kill_at_once``: SIGKILL to
  every step then the batch step, which is the only thing that kills at once (a job-level
  ``scancel --signal=KILL --full`` waits KillWait too).
- ``same_run(recorded, now) -> bool``: see its docstring (a job id alone is not proof).
- ``node_states(nodes)`` / ``down_nodes(states)``: which of a job's nodes Slurm holds as failed (a
  NODE_FAIL names them); ``kill_wait_s()``: the cluster's KillWait.
- ``verdict(state, log_tail, *, requested_mem_bytes=None, killed_by_supervisor=False) -> dict``:
  diagnosis evidence:
  ``exit`` (ExitRecord fields), ``host`` (HostEvidence fields), ``scheduler_state``,
  ``interrupted`` (NODE_FAIL, PREEMPTED, BOOT_FAIL: resume, no budget), ``timeout``, ``cancelled``,
  ``evidence`` (the log lines it rests on); ``records(v)`` -> (ExitRecord, HostEvidence).
- ``observed(submission, state) -> dict``: what to record once the job is seen started.

Wiring advice, tested in tests/slurm/test_slurm_shim.py: run the launch shim inside the job
(``launcher_prefix=[python, "-m", "supervisor.run.shim"]``, argv ``[launch.json]``). Slurm's SIGTERM
reaches only the batch process; torchrun-like workers in their own sessions would be SIGKILLed
unwarned, while the shim forwards SIGTERM to every descendant and writes exit.json in the job.

Seen here: while a killed job is COMPLETING (up to KillWait, 30 s) slurmctld starts no other job
on the node, so the attempt after a hard cancel may wait that long in PENDING.

Multi-node (nodes > 1), run on scripts/slurm2.sh (two slurmd in network namespaces): the batch
script ``exec``s ``srun --ntasks-per-node=1`` so each node runs one shim with LLaMA-Factory's own
variables (``NNODES``, ``NODE_RANK`` = ``SLURM_NODEID``, ``MASTER_ADDR`` = first host of
``scontrol show hostnames $SLURM_JOB_NODELIST``, ``MASTER_PORT``, ``FORCE_TORCHRUN=1``); the shim
merges them and Slurm's allocation into the attempt's environment (``shim.job_environment``) and
writes ``exit-<node>.json``, judged together by ``supervisor.judge.nodes``.
Measured behaviour behind each choice: ../shared/docs/slurm.md.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from supervisor.core.models import ExitRecord, HostEvidence
from supervisor.intake.slurm_request import SlurmJobRequest, SlurmSettings, format_time  # noqa: F401
from supervisor.run.fsutil import atomic_write_text

CMD_TIMEOUT_S = 30.0
# squeue/scontrol are RPCs to slurmctld; a site's controller serves every user. One squeue for all
# followed jobs every 5 s is far below what sites tolerate (they ask for >= 1 s between calls per
# user); the log, not Slurm, is what gives the live picture, so a slower poll loses nothing.
POLL_INTERVAL_S = 5.0
BATCH_SCRIPT = "slurm_batch.sh"
DEFAULT_MASTER_PORT = 29500

RUNNING_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED",
                            "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SIGNALING",
                            "STAGE_OUT", "RESV_DEL_HOLD", "STOPPED"})
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "OUT_OF_MEMORY", "TIMEOUT", "NODE_FAIL",
                             "PREEMPTED", "CANCELLED", "BOOT_FAIL", "DEADLINE", "REVOKED",
                             "SPECIAL_EXIT"})
INTERRUPTED_STATES = frozenset({"NODE_FAIL", "PREEMPTED", "BOOT_FAIL"})
SLURM_OOM_SIGNAL = 125  # ExitCode=0:125 is Slurm's mark for a step the cgroup OOM-killed

_OOM_LINE_RE = re.compile(r"Detected (\d+) oom[-_ ]kill event\(s\) in StepId=(\S+?)\.?\s")
_KEY_RE = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/]*)=")


class SlurmError(RuntimeError):
    """A Slurm command failed; the message names the command and its stderr."""


class SlurmUnavailable(SlurmError):
    """The controller did not answer (down, restarting, overloaded): ask again later; nothing
    is known about the job from this. Measured: with slurmctld down, scontrol/squeue give up only
    after ~18 s (MessageTimeout and retries), so callers pass a timeout_s their loop can afford."""


_UNREACHABLE = ("Unable to contact slurm controller", "Socket timed out", "Zero Bytes were transmitted",
                "Connection refused", "Communication connection failure")


@dataclass(frozen=True)
class SlurmSubmission:
    job_id: str
    submitted_at: float
    script: Path
    job_name: str | None = None
    nodes: int = 1

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["script"] = str(self.script)
        return d


@dataclass(frozen=True)
class SlurmJobState:
    job_id: str
    state: str
    reason: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    derived_exit_code: int | None = None
    derived_signal: int | None = None
    restarts: int = 0
    submit_time: float | None = None
    start_time: float | None = None   # None while PENDING (Slurm shows an estimate there)
    end_time: float | None = None
    node_list: str | None = None
    batch_host: str | None = None
    job_name: str | None = None
    memory_limit_bytes: int | None = None
    source: str = "scontrol"          # scontrol | sacct-jobcomp | squeue

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def running(self) -> bool:
        return self.state in RUNNING_STATES

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _run(argv: list[str], env: Mapping[str, str] | None = None, timeout: float = CMD_TIMEOUT_S,
         ok_codes: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(argv, check=False, capture_output=True, text=True, env=None if env is None else dict(env),
                             timeout=timeout, errors="replace")
    except FileNotFoundError as e:
        raise SlurmError(f"{argv[0]} not found: is the Slurm client installed and on PATH?") from e
    except subprocess.TimeoutExpired as e:
        raise SlurmUnavailable(f"{shlex.join(argv)} did not answer within {timeout:g} s") from e
    if any(w in res.stderr for w in _UNREACHABLE):
        raise SlurmUnavailable(f"{shlex.join(argv)}: {res.stderr.strip()[:2000]}")
    if res.returncode not in ok_codes:
        raise SlurmError(f"{shlex.join(argv)} exited {res.returncode}: {res.stderr.strip()[:2000]}")
    return res


# ---------------------------------------------------------------- submit

def batch_script(argv: list[str], *, launcher_prefix: list[str], nodes: int,
                 master_port: int = DEFAULT_MASTER_PORT) -> str:
    """The batch script: `exec` the launcher (one node) or `exec srun` one launcher per node."""
    cmd = shlex.join([*launcher_prefix, *argv])
    lines = ["#!/bin/bash", "# Written by oom-supervisor. exec: Slurm's SIGTERM must reach the launcher.",
             'echo "oom-supervisor: slurm job $SLURM_JOB_ID on $(hostname) restart ${SLURM_RESTART_COUNT:-0}" >&2']
    if nodes <= 1:
        lines.append(f"exec {cmd}")
    else:
        # LLaMA-Factory's multi-node variables per task (run on scripts/slurm2.sh's two nodes).
        lines += ['export NNODES="$SLURM_JOB_NUM_NODES"',
                  'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
                  f'export MASTER_PORT="${{MASTER_PORT:-{master_port}}}"',
                  "export FORCE_TORCHRUN=1",
                  'exec srun --ntasks-per-node=1 --nodes="$NNODES" --kill-on-bad-exit=1 '
                  "bash -c 'export NODE_RANK=\"$SLURM_NODEID\"; exec \"$@\"' oom-supervisor-node "
                  + cmd]
    return "\n".join(lines) + "\n"


def sbatch_args(log: Path, cwd: Path, *, settings: SlurmSettings, request: SlurmJobRequest | None,
                job_name: str, run_as: tuple[int, int] | None = None) -> list[str]:
    """sbatch's options for one attempt; the job's request overrides the site's settings.
    `run_as` (uid, gid): a shared box's daemon (root) submits each attempt as the job's submitter
    (`--uid/--gid`, root only: sbatch drops to that user once the allocation is made), so Slurm
    accounts, limits and runs it as them."""
    req = request or SlurmJobRequest()
    nodes = req.nodes or settings.nodes
    gpus = req.gpus_per_node if req.gpus_per_node is not None else settings.gpus_per_node
    mem = req.mem if req.mem is not None else settings.mem
    tlimit = req.time or settings.time_limit
    args = ["--parsable", f"--job-name={job_name}", f"--output={log}", f"--error={log}",
            "--open-mode=append", f"--chdir={cwd}", "--export=ALL", f"--nodes={nodes}",
            # Slurm requeues on node failure or preemption by itself, rerunning this attempt's
            # rendered config (its old resume point, its remedies): the daemon plans the next
            # attempt instead, so NODE_FAIL/PREEMPTED end it (a site may pass --requeue back).
            "--no-requeue"]
    if nodes > 1:
        args.append("--ntasks-per-node=1")
    if gpus:
        args.append(f"--gres=gpu:{gpus}")
    if mem is not None:
        args.append(f"--mem={math.ceil(mem / (1 << 20))}M")
    if tlimit:
        args.append(f"--time={tlimit}")
    if settings.partition:
        args.append(f"--partition={settings.partition}")
    if settings.account:
        args.append(f"--account={settings.account}")
    if run_as is not None:
        args += [f"--uid={int(run_as[0])}", f"--gid={int(run_as[1])}"]
    return args + list(settings.extra_args)


def _sbatch_env(env: Mapping[str, str]) -> dict[str, str]:
    """The attempt's environment for sbatch (--export=ALL hands it to the job).

    SLURM_* left over from a daemon that itself runs inside an allocation would describe the
    wrong job, so they are dropped (SLURM_CONF kept, taken from the daemon when the attempt lacks
    it: sbatch needs it to find the controller)."""
    out = {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    if "SLURM_CONF" not in out and os.environ.get("SLURM_CONF"):
        out["SLURM_CONF"] = os.environ["SLURM_CONF"]
    out.setdefault("PATH", os.environ.get("PATH", "/usr/bin:/bin"))
    return out


def submit(attempt_dir: Path, log: Path, argv: list[str], cwd: Path, env: dict[str, str], *,
           settings: SlurmSettings, request: SlurmJobRequest | None, job_name: str,
           run_as: tuple[int, int] | None = None) -> SlurmSubmission:
    """Write the batch script into attempt_dir and sbatch it (as `run_as` (uid, gid) when given:
    see sbatch_args); the job id Slurm gave."""
    if not argv:
        raise ValueError("submit: empty argv")
    nodes = (request.nodes if request and request.nodes else None) or settings.nodes
    script = Path(attempt_dir) / BATCH_SCRIPT
    atomic_write_text(script, batch_script(argv, launcher_prefix=settings.launcher_prefix, nodes=nodes),
                      mode=0o755)
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    cmd = ["sbatch", *sbatch_args(Path(log), Path(cwd), settings=settings, request=request,
                                  job_name=job_name, run_as=run_as), str(script)]
    submitted_at = time.time()
    res = _run(cmd, env=_sbatch_env(env))
    job_id = res.stdout.strip().split(";", 1)[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed no job id: {res.stdout.strip()[:200]!r} {res.stderr.strip()[:500]}")
    return SlurmSubmission(job_id=job_id, submitted_at=submitted_at, script=script, job_name=job_name, nodes=nodes)


# ---------------------------------------------------------------- query

def parse_keyvalues(line: str) -> dict[str, str]:
    """`Key=value Key2=a value with spaces ...` (scontrol --oneliner); first occurrence wins
    (-d repeats per-node keys such as Nodes= and Mem= later in the line)."""
    out: dict[str, str] = {}
    matches = list(_KEY_RE.finditer(line))
    for m, nxt in zip(matches, [*matches[1:], None]):
        value = line[m.end(): nxt.start() if nxt else len(line)].strip()
        out.setdefault(m.group(1), value)
    return out


def _epoch(v: str | None) -> float | None:
    if not v or v in ("Unknown", "None", "N/A", "(null)"):
        return None
    try:
        return datetime.strptime(v, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def _codes(v: str | None) -> tuple[int | None, int | None]:
    if not v or ":" not in v:
        return None, None
    a, _, b = v.partition(":")
    try:
        return int(a), int(b)
    except ValueError:
        return None, None


def _mem_bytes(v: str | None) -> int | None:
    """'200M', '4G', '1024' (MiB) -> bytes; Slurm's '0'/None mean no limit."""
    if not v:
        return None
    m = re.match(r"^(\d+(?:\.\d+)?)([KMGTP]?)", v)
    if not m or float(m.group(1)) == 0:
        return None
    return int(float(m.group(1)) * (1 << {"K": 10, "": 20, "M": 20, "G": 30, "T": 40, "P": 50}[m.group(2)]))


def _null(v: str | None) -> str | None:
    return None if v in (None, "", "(null)", "None", "N/A") else v


def state_from_scontrol(line: str) -> SlurmJobState:
    kv = parse_keyvalues(line)
    if "JobId" not in kv or "JobState" not in kv:
        raise SlurmError(f"scontrol output without JobId/JobState: {line[:300]!r}")
    state = kv["JobState"].split()[0]
    ec, sig = _codes(kv.get("ExitCode"))
    dec, dsig = _codes(kv.get("DerivedExitCode"))
    try:
        restarts = int(kv.get("Restarts", "0"))
    except ValueError:
        restarts = 0
    return SlurmJobState(
        job_id=kv["JobId"], state=state, reason=_null(kv.get("Reason")), exit_code=ec, signal=sig,
        derived_exit_code=dec, derived_signal=dsig, restarts=restarts,
        submit_time=_epoch(kv.get("SubmitTime")),
        start_time=None if state == "PENDING" else _epoch(kv.get("StartTime")),
        end_time=_epoch(kv.get("EndTime")) if state not in RUNNING_STATES else None,
        node_list=_null(kv.get("NodeList")), batch_host=_null(kv.get("BatchHost")),
        job_name=_null(kv.get("JobName")),
        memory_limit_bytes=_mem_bytes(kv.get("MinMemoryNode")), source="scontrol")


_SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "DerivedExitCode", "Start", "End", "NodeList")


def query_jobcomp(job_id: str, *, timeout_s: float = CMD_TIMEOUT_S) -> SlurmJobState | None:
    """`sacct -c` (reads the jobcomp file; works without slurmdbd): the last record of the job."""
    res = _run(["sacct", "-c", "-n", "-P", "-j", str(job_id), "-o", ",".join(_SACCT_FIELDS)],
               ok_codes=(0, 1), timeout=timeout_s)
    rows = [dict(zip(_SACCT_FIELDS, ln.split("|"))) for ln in res.stdout.splitlines() if ln.strip()]
    rows = [r for r in rows if r.get("JobID") == str(job_id)]
    if not rows:
        return None
    r = rows[-1]  # a requeued job has one line per run; the last is the latest
    ec, sig = _codes(r.get("ExitCode"))
    dec, dsig = _codes(r.get("DerivedExitCode"))
    return SlurmJobState(job_id=str(job_id), state=r["State"].split()[0], exit_code=ec, signal=sig,
                         derived_exit_code=dec, derived_signal=dsig, restarts=len(rows) - 1,
                         # sacct -c's Submit column is the start time (measured): unknown instead.
                         submit_time=None, start_time=_epoch(r.get("Start")),
                         end_time=_epoch(r.get("End")), node_list=_null(r.get("NodeList")),
                         job_name=_null(r.get("JobName")), source="sacct-jobcomp")


def query(job_id: str, *, timeout_s: float = CMD_TIMEOUT_S) -> SlurmJobState | None:
    """The job's state from scontrol; from the jobcomp file once scontrol forgot it; else None
    (a job the controller lost: submitted after its last state save and then killed -9).
    SlurmUnavailable when the controller does not answer within timeout_s."""
    res = _run(["scontrol", "-d", "show", "job", str(job_id), "--oneliner"], ok_codes=(0, 1),
               timeout=timeout_s)
    if res.returncode == 0 and res.stdout.strip():
        return state_from_scontrol(res.stdout.strip().splitlines()[0])
    if "Invalid job id" not in res.stderr:
        raise SlurmError(f"scontrol show job {job_id}: {res.stderr.strip()[:2000]}")
    return query_jobcomp(job_id, timeout_s=timeout_s)


_SQUEUE_FIELDS = ("JobID", "State", "Reason", "RestartCnt", "SubmitTime", "StartTime", "EndTime",
                  "NodeList", "BatchHost", "Name")
# Per job id: when squeue last answered for it and what it said (None: squeue did not know it).
_seen: dict[str, tuple[float, SlurmJobState | None]] = {}
_asked: dict[str, float] = {}  # per job id: when a caller last asked (the followed set)


def query_many(job_ids: list[str], *, max_age_s: float = POLL_INTERVAL_S,
               timeout_s: float = CMD_TIMEOUT_S) -> dict[str, SlurmJobState]:
    """States of many jobs in one squeue call (jobs it no longer knows are absent: ask `query`).

    No exit codes here (squeue has none worth trusting). Answers are cached per job for
    max_age_s, and a refresh asks squeue about every job any caller asked about lately, so
    one handle per attempt calling query_many([its id]) still costs one squeue per interval."""
    bad = [j for j in job_ids if not str(j).isdigit()]
    if bad:
        raise ValueError(f"not Slurm job ids: {bad[:5]!r}")
    ids = {str(j) for j in job_ids}
    now = time.monotonic()
    for j in ids:
        _asked[j] = now
    stale = [j for j in ids if j not in _seen or now - _seen[j][0] >= max_age_s]
    if stale:
        horizon = max(max_age_s, POLL_INTERVAL_S) * 4
        for j in [j for j, t in _asked.items() if now - t > horizon]:
            _asked.pop(j, None)
            _seen.pop(j, None)
        batch = sorted(set(_asked) | ids, key=int)
        got = _squeue([f"--jobs={','.join(batch)}"], timeout_s)
        for j in batch:
            _seen[j] = (now, got.get(j))
    return {j: st for j in ids if (st := _seen[j][1]) is not None}


def _squeue(select: list[str], timeout_s: float) -> dict[str, SlurmJobState]:
    fmt = ",".join(f"{f}:|" for f in _SQUEUE_FIELDS)
    res = _run(["squeue", "-h", "-t", "all", *select, "-O", fmt], ok_codes=(0, 1), timeout=timeout_s)
    if res.returncode == 1 and "Invalid job id" not in res.stderr:
        raise SlurmError(f"squeue: {res.stderr.strip()[:2000]}")
    out: dict[str, SlurmJobState] = {}
    for ln in res.stdout.splitlines():
        parts = [p.strip() for p in ln.split("|")]
        if len(parts) < len(_SQUEUE_FIELDS):
            continue
        r = dict(zip(_SQUEUE_FIELDS, parts))
        state = r["State"]
        out[r["JobID"]] = SlurmJobState(
            job_id=r["JobID"], state=state, reason=_null(r["Reason"]),
            restarts=int(r["RestartCnt"]) if r["RestartCnt"].isdigit() else 0,
            submit_time=_epoch(r["SubmitTime"]),
            start_time=None if state == "PENDING" else _epoch(r["StartTime"]),
            end_time=_epoch(r["EndTime"]) if state not in RUNNING_STATES else None,
            node_list=_null(r["NodeList"]), batch_host=_null(r["BatchHost"]),
            job_name=_null(r["Name"]), source="squeue")
    return out


def find_by_name(job_name: str, *, timeout_s: float = CMD_TIMEOUT_S) -> dict[str, SlurmJobState]:
    """Jobs the controller knows under this name: after a submit that raised SlurmUnavailable
    (sbatch timed out or lost its answer, the job may exist), look here before submitting again."""
    return _squeue([f"--name={job_name}"], timeout_s)


# ---------------------------------------------------------------- cancel

def cancel(job_id: str, *, hard: bool, kill_now: bool = False, steps_only: bool = False,
           timeout_s: float = CMD_TIMEOUT_S) -> list[str]:
    """Soft: SIGTERM to the shims, which forward it to their workers; the caller waits and
    escalates. One node: the batch step is the exec'd shim (--full). Several (`steps_only`): the
    srun step's tasks on every node, never the batch step: there it is srun, and srun answers a
    SIGTERM by cancelling the whole job ("forcing job termination": every node's tasks SIGKILLed
    at once, no time to save; seen on scripts/slurm2.sh). Hard: `scancel` (SIGTERM, then SIGKILL
    of the job cgroup after KillWait). kill_now: SIGKILL at once (`kill_at_once`). Returns the
    commands run, for the record."""
    if kill_now:
        return kill_at_once(job_id, timeout_s=timeout_s)
    soft = ["scancel", "--signal=TERM", str(job_id)] if steps_only else ["scancel", "--signal=TERM", "--full", str(job_id)]
    argv = soft if not hard else ["scancel", str(job_id)]
    _scancel(argv, timeout_s)
    return [shlex.join(argv)]


def kill_at_once(job_id: str, *, timeout_s: float = CMD_TIMEOUT_S) -> list[str]:
    """SIGKILL every process of the job now, on every node.

    Measured (scripts/slurm2.sh, KillWait 30): every job-level cancel, `scancel --signal=KILL
    --full J` included, is SIGCONT+SIGTERM then SIGKILL only after KillWait (29.8-30.9 s). What
    kills at once (0.04-0.15 s) is signalling the steps: `scancel --signal=KILL J.S` for each srun
    step, then `scancel --signal=KILL --batch J` for the batch step (its whole cgroup, background
    and setsid processes included); in that order, since once the job is ending step signals are
    refused. The price: Slurm then records FAILED/JobLaunchFailure 0:9 (or, for steps alone,
    COMPLETED with DerivedExitCode 0:9), so the caller must remember that the kill was its own
    (`verdict(..., killed_by_supervisor=True)`)."""
    res = _run(["squeue", "-h", "-s", "-j", str(job_id), "-o", "%i"], ok_codes=(0, 1), timeout=timeout_s)
    steps = [s.strip() for s in res.stdout.split() if re.fullmatch(rf"{re.escape(str(job_id))}\.\d+", s.strip())]
    done = []
    for step in steps:
        argv = ["scancel", "--signal=KILL", step]
        _scancel(argv, timeout_s)
        done.append(shlex.join(argv))
    argv = ["scancel", "--signal=KILL", "--batch", str(job_id)]
    _scancel(argv, timeout_s)
    return [*done, shlex.join(argv)]


def _scancel(argv: list[str], timeout_s: float) -> None:
    res = _run(argv, ok_codes=(0, 1), timeout=timeout_s)
    # An already finished job (or step) is not an error for a cancel: it is gone either way.
    if res.returncode != 0 and "already completing or completed" not in res.stderr \
            and "Invalid job id" not in res.stderr and "Job/step already completing" not in res.stderr:
        raise SlurmError(f"{shlex.join(argv)}: {res.stderr.strip()[:2000]}")


def kill_wait_s(*, timeout_s: float = CMD_TIMEOUT_S) -> float | None:
    """The cluster's KillWait (seconds between a job cancel's SIGTERM and its SIGKILL)."""
    res = _run(["scontrol", "show", "config"], ok_codes=(0, 1), timeout=timeout_s)
    m = re.search(r"^KillWait\s*=\s*(\d+)", res.stdout, re.MULTILINE)
    return float(m.group(1)) if m else None


def node_states(nodes: list[str], *, timeout_s: float = CMD_TIMEOUT_S) -> dict[str, tuple[str, str | None]]:
    """{node: (State, Reason)} as slurmctld sees them now (`scontrol show node`)."""
    if not nodes:
        return {}
    res = _run(["scontrol", "show", "node", ",".join(nodes), "--oneliner"], ok_codes=(0, 1), timeout=timeout_s)
    out: dict[str, tuple[str, str | None]] = {}
    for ln in res.stdout.splitlines():
        kv = parse_keyvalues(ln)
        if "NodeName" in kv:
            out[kv["NodeName"]] = (kv.get("State", ""), _null(kv.get("Reason")))
    return out


def down_nodes(states: Mapping[str, tuple[str, str | None]]) -> dict[str, str]:
    """Of `node_states`, the nodes Slurm holds as failed: DOWN, FAIL, or not responding ('*')."""
    out = {}
    for node, (state, reason) in states.items():
        if re.search(r"DOWN|FAIL|NOT_RESPONDING|\*", state):
            out[node] = f"{node}: {state}" + (f" Reason={reason}" if reason else "")
    return out


# ---------------------------------------------------------------- same run?

def observed(submission: SlurmSubmission | Mapping[str, Any], state: SlurmJobState) -> dict[str, Any]:
    """What to record once the job is seen started: the submission plus start time and restarts,
    so that a later `same_run` can tell a relaunch under the same id."""
    rec = dict(submission.to_dict() if isinstance(submission, SlurmSubmission) else submission)
    if state.start_time is not None and state.state != "PENDING":
        rec.setdefault("start_time", state.start_time)
        rec.setdefault("restarts", state.restarts)
    return rec


def same_run(recorded: Mapping[str, Any], now: SlurmJobState) -> bool:
    """Is `now` still the run the daemon launched (and whose log it has read)?

    A job id is not proof: a controller whose state was wiped reuses ids, and a slurmctld
    killed right after a start relaunches the job under the same id with Restarts=0 and a
    truncated output. The rule, each check only when the record has the fact:
    - same job id and job name;
    - Slurm's SubmitTime (whole seconds) not before our sbatch call (2 s slack for rounding);
    - once we saw it start: the same Restarts and the same StartTime (to the second), and it is
      not PENDING again (a relaunch waits in PENDING first).
    A job never seen started cannot be told from its relaunch; it is taken as the same run.
    """
    if str(recorded.get("job_id")) != str(now.job_id):
        return False
    name = recorded.get("job_name")
    if name and now.job_name and name != now.job_name:
        return False
    sub = recorded.get("submitted_at")
    if sub is not None and now.submit_time is not None and now.submit_time < float(sub) - 2:
        return False
    if recorded.get("start_time") is not None:
        if now.state == "PENDING" or now.start_time is None:
            return False
        if now.restarts != int(recorded.get("restarts") or 0):
            return False
        if abs(now.start_time - float(recorded["start_time"])) >= 1:
            return False
    elif recorded.get("restarts") is not None and now.restarts != int(recorded["restarts"]):
        return False
    return True


# ---------------------------------------------------------------- verdict

def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"SIG{n}"


def verdict(state: SlurmJobState, log_tail: str, *, requested_mem_bytes: int | None = None,
            killed_by_supervisor: bool = False) -> dict[str, Any]:
    """Slurm's verdict as diagnosis evidence (fields of ExitRecord and HostEvidence).

    OOM: OUT_OF_MEMORY, ExitCode or DerivedExitCode ...:125, or the step's "Detected N
    oom-kill event(s)" line; also when the batch script exited 0 (an OOM inside an srun step
    the script did not propagate). Then the exit is reported as the cgroup killer's SIGKILL,
    since a 0 would read as success. NODE_FAIL/PREEMPTED/BOOT_FAIL are interruptions (resume).
    `records(verdict(...))` gives the ExitRecord and HostEvidence the classifier takes.
    killed_by_supervisor: the daemon SIGKILLed the job's steps itself (`kill_at_once`): Slurm's
    FAILED/JobLaunchFailure 0:9 (or COMPLETED with DerivedExitCode 0:9) is that kill, never the
    trainer's outcome: the exit is reported as our SIGKILL and the evidence says so."""
    evidence: list[str] = []
    kills = 0
    for ln in log_tail.splitlines():
        m = _OOM_LINE_RE.search(ln + " ")
        if m:
            kills += int(m.group(1))
            evidence.append(ln.strip())
    oom = (state.state == "OUT_OF_MEMORY" or state.signal == SLURM_OOM_SIGNAL
           or state.derived_signal == SLURM_OOM_SIGNAL or kills > 0)
    if oom and kills == 0:
        kills = 1  # Slurm's own word: one step at least was OOM-killed in the cgroup
    code, sig = state.exit_code, state.signal
    if oom or killed_by_supervisor:
        returncode, signame = -signal.SIGKILL, "SIGKILL"
    elif sig:
        returncode, signame = -sig, _signame(sig)
    elif state.state == "COMPLETED" and state.derived_exit_code and code == 0:
        returncode, signame = 0, None  # the script chose to ignore a failed step: its decision
    else:
        returncode, signame = code, None
    if state.state in ("CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED") and returncode == 0:
        returncode = None  # Slurm ended it; 0:0 here is not a success of the training
    words = f"Slurm {state.state} ExitCode={code}:{sig} DerivedExitCode={state.derived_exit_code}:{state.derived_signal}"
    if state.reason:
        words += f" Reason={state.reason}"
    evidence.insert(0, words)
    if killed_by_supervisor:
        evidence.insert(1, "the supervisor SIGKILLed the job's steps itself (scancel --signal=KILL per step, "
                           f"then --batch): Slurm's {state.state} is that kill, not the training's outcome")
    for ln in log_tail.splitlines():
        if re.search(r"\*\*\* (?:JOB|STEP) \S+ ON \S+ CANCELLED AT", ln):
            evidence.append(ln.strip())
    host = {"cgroup_oom_kills": kills if oom else 0, "limit_mechanism": "slurm-cgroup",
            # The jobcomp fallback has no memory figure: then what the attempt asked sbatch for.
            "memory_limit_bytes": state.memory_limit_bytes or requested_mem_bytes,
            "scheduler_state": state.state}
    return {"exit": {"returncode": returncode, "signal": signame}, "host": host,
            "scheduler_state": state.state, "interrupted": state.state in INTERRUPTED_STATES,
            "timeout": state.state in ("TIMEOUT", "DEADLINE"), "cancelled": state.state == "CANCELLED",
            "evidence": evidence}


def records(v: Mapping[str, Any]) -> tuple[ExitRecord, HostEvidence]:
    """A verdict's evidence as the classifier's inputs (diagnose_bytes(log, exit, host))."""
    return ExitRecord(**v["exit"]), HostEvidence(**v["host"])
