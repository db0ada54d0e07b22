"""The morning report: what happened overnight, as one self-contained HTML page (plots embedded
as base64 PNG) and a Markdown summary beside it (with the PNGs as files).

Per job: the loss of every attempt on one global-step axis (LLaMA-Factory's trainer_log.jsonl
holds all attempts: steps restart at the resume checkpoint), each failure marked with its
diagnosis and the remedy that followed; peak memory per attempt against the limit; throughput
per attempt; time and steps lost. Gathering (`collect`) reads the record and the logs; drawing
and rendering work on what it returns.
"""

from __future__ import annotations

import base64
import html
import io
import json
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from supervisor.core.paths import StatePaths
from supervisor.record.store import Store
from supervisor.run.progress import TRAINER_LOG, _parse_lines, parse_elapsed
from supervisor.service.escape import markdown_cell, markdown_text

GiB = float(1 << 30)
NIGHT_KEY, NIGHT_IMAGE = -1, "night-goodput.png"  # the night's picture, among the jobs' (keyed by job id)
FAILED_OUTCOMES_SKIP = ("success", "running", "interrupted")


@dataclass
class AttemptView:
    number: int
    started_at: float
    ended_at: float | None
    outcome: str                    # diagnosis category, running, interrupted
    summary: str
    vendor: str | None
    decision: str | None            # escalate/retry/fail/done...
    next_remedy: str | None         # the rung the decision chose for the next attempt
    remedy: str | None              # what this attempt ran with
    resumed_from_step: int | None
    max_step: int | None
    steps_lost: int | None
    peak_host: int | None
    host_limit: int | None
    peak_gpu: int | None
    gpu_capacity: int | None
    steps_per_s: float | None
    tokens_per_s: float | None
    losses: list[tuple[int, float]] = field(default_factory=list)
    emergency: dict | None = None   # the emergency_checkpoint event's data (supervisor.hooks.markers.describe)

    @property
    def duration_s(self) -> float | None:
        return None if self.ended_at is None else self.ended_at - self.started_at

    @property
    def failed(self) -> bool:
        return self.ended_at is not None and self.outcome not in FAILED_OUTCOMES_SKIP


@dataclass
class JobView:
    id: int
    name: str
    state: str
    reason: str | None
    total_steps: int | None
    attempts: list[AttemptView]
    log_note: str | None = None     # why the loss curve is missing, when it is
    goodput: Any = None             # supervisor.judge.goodput.JobGoodput: where its wall time went

    @property
    def ooms(self) -> int:
        return sum(a.outcome in ("gpu_oom", "host_oom") for a in self.attempts)

    @property
    def remedies(self) -> list[str]:
        return [a.next_remedy for a in self.attempts if a.next_remedy]

    @property
    def steps_lost(self) -> int:
        return sum(a.steps_lost or 0 for a in self.attempts if a.failed)

    @property
    def time_lost_s(self) -> float:
        """Wall time of the attempts that failed (their work after the last checkpoint is gone)."""
        return sum(a.duration_s or 0.0 for a in self.attempts if a.failed)

    @property
    def wall_s(self) -> float | None:
        if not self.attempts:
            return None
        end = max((a.ended_at or time.time()) for a in self.attempts)
        return end - self.attempts[0].started_at

    @property
    def last_step(self) -> int | None:
        steps = [a.max_step for a in self.attempts if a.max_step is not None]
        return max(steps) if steps else None


@dataclass
class Night:
    generated_at: float
    since: float | None
    host: str
    jobs: list[JobView]

    @property
    def goodput(self):
        """The jobs' buckets added up (job-hours, not clock hours, where jobs overlap)."""
        from supervisor.judge.goodput import breakdown

        return breakdown(j.goodput.total for j in self.jobs if j.goodput is not None)


# --- gathering (I/O) -----------------------------------------------------------------------

def collect(store: Store, state: StatePaths, job_ids: list[int] | None = None, *,
            since: float | None = None, now: float | None = None) -> Night:
    now = time.time() if now is None else now
    jobs = []
    for job in store.jobs():
        if job_ids and job.id not in job_ids:
            continue
        rows = store.attempts(job.id)
        if not job_ids and since is not None and job.updated_at < since and not any(
                a.started_at >= since or a.ended_at is None or (a.ended_at or 0) >= since for a in rows):
            continue
        events = store.events(job.id)
        limits = {e.attempt: (json.loads(e.data) if e.data else {}).get("memory_limit")
                  for e in events if e.kind == "attempt_started"}
        gpu = {e.attempt: json.loads(e.data) for e in events if e.kind == "gpu_telemetry" and e.data}
        emergency = {e.attempt: json.loads(e.data) for e in events if e.kind == "emergency_checkpoint" and e.data}
        attempts = []
        for a in rows:
            diag = a.json("diagnosis") or {}
            dec = a.json("decision") or {}
            g = gpu.get(a.number) or {}
            peak_gpu = max((int(v) for v in (g.get("peak_bytes") or {}).values()), default=None)
            cap = min((int(v) for v in (g.get("capacity_bytes") or {}).values()), default=None)
            if cap is None and diag.get("category") == "gpu_oom":
                cap = (diag.get("numbers") or {}).get("total_capacity")
            outcome = ("running" if a.ended_at is None else "interrupted" if a.interrupted
                       else str(diag.get("category") or "unknown"))
            attempts.append(AttemptView(
                number=a.number, started_at=a.started_at, ended_at=a.ended_at, outcome=outcome,
                summary=str(diag.get("summary") or dec.get("reason") or ""), vendor=diag.get("vendor"),
                decision=dec.get("kind"), next_remedy=dec.get("rung") if dec.get("kind") == "escalate" else None,
                remedy=a.remedy, resumed_from_step=a.resumed_from_step, max_step=a.max_step,
                steps_lost=a.steps_lost, peak_host=a.peak_rss_bytes, host_limit=limits.get(a.number),
                peak_gpu=peak_gpu, gpu_capacity=cap, steps_per_s=a.steps_per_s, tokens_per_s=a.tokens_per_s,
                emergency=emergency.get(a.number)))
        view = JobView(job.id, job.name, str(job.state), job.reason,
                       next((a.total_steps for a in reversed(rows) if a.total_steps), None), attempts)
        view.goodput = _goodput(store, job, now)
        out = _output_dir(state, job)
        if out is None:
            view.log_note = "no output_dir (not a LLaMA-Factory job): no loss curve"
        else:
            try:
                data = (out / TRAINER_LOG).read_bytes()
                records, _bad = _parse_lines(data.split(b"\n"))
                assign_by_record(attempts, records)
            except FileNotFoundError:
                view.log_note = f"{out / TRAINER_LOG} not found: no loss curve"
        jobs.append(view)
    return Night(generated_at=now, since=since, host=socket.gethostname(), jobs=jobs)


def _goodput(store: Store, job, now: float):
    from supervisor.record.timing import goodput_of

    try:
        return goodput_of(store, job, now=now)
    except Exception:  # noqa: BLE001 - the rest of the report stands without it
        return None


def _output_dir(state: StatePaths, job) -> Path | None:
    try:
        cfg = yaml.safe_load(state.job(job.id).job_file.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    out = cfg.get("output_dir") if isinstance(cfg, dict) else None
    if not out:
        return None
    p = Path(str(out)).expanduser()
    return p if p.is_absolute() else Path(job.workdir) / p


def split_runs(records: list[dict[str, Any]]) -> list[list[tuple[int, float]]]:
    """(step, loss) runs, a new one wherever LLaMA-Factory restarted: the step went down, or the
    timer went back (a resumed run's clock starts at 0 while its steps go on from the checkpoint,
    so the step alone does not show the seam)."""
    runs: list[list[tuple[int, float]]] = []
    prev_step = prev_t = None
    for r in records:
        step, loss = r.get("current_steps"), r.get("loss")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        t = parse_elapsed(r.get("elapsed_time"))
        if not runs or (prev_step is not None and (
                step < prev_step or (t is not None and prev_t is not None and t < prev_t))):
            runs.append([])
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            runs[-1].append((step, float(loss)))
        prev_step, prev_t = step, t
    return runs


def assign_by_record(attempts: list[AttemptView], records: list[dict[str, Any]]) -> None:
    """Give each logged (step, loss) to its attempt by the record's boundaries, not by seams in
    the log: attempt k holds the steps after the one it resumed from up to the last it reached,
    and ran no longer than it lived. After an emergency checkpoint the log may show no seam at
    all (attempt 1's step 8, then attempt 3's step 9 with a timer that happens to be later): the
    record still says step 9 is attempt 3's. A seam the log does show (the step or the timer went
    back) also moves on to the next attempt holding that step."""
    def holds(a: AttemptView, step: int, t: float | None) -> bool:
        lo = a.resumed_from_step or 0
        hi = a.max_step if a.max_step is not None else (None if a.ended_at is None else lo)
        if step <= lo or (hi is not None and step > hi):
            return False
        return t is None or a.duration_s is None or t <= a.duration_s + 5.0

    i = 0
    prev_step = prev_t = None
    for r in records:
        step, loss = r.get("current_steps"), r.get("loss")
        if not isinstance(step, int) or isinstance(step, bool) or not attempts:
            continue
        t = parse_elapsed(r.get("elapsed_time"))
        seam = prev_step is not None and (step < prev_step or (t is not None and prev_t is not None and t < prev_t))
        prev_step, prev_t = step, t
        if seam or not holds(attempts[i], step, t):
            nxt = next((j for j in range(i + 1, len(attempts)) if holds(attempts[j], step, t)), None)
            if nxt is None:
                continue  # a step no attempt of the record reached: not drawn rather than drawn wrong
            i = nxt
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            attempts[i].losses.append((step, float(loss)))


def assign_losses(attempts: list[AttemptView], runs: list[list[tuple[int, float]]]) -> None:
    """Give each run to the first attempt, in order, whose step range holds its first step.
    Attempts that logged no step (died while loading) take none."""
    i = 0
    for run in runs:
        if not run:
            continue
        first = run[0][0]
        for j in range(i, len(attempts)):
            a = attempts[j]
            lo = a.resumed_from_step or 0
            if a.max_step is not None and lo < first <= max(a.max_step, first if a.ended_at is None else 0):
                a.losses.extend(run)
                i = j + 1
                break


# --- drawing -------------------------------------------------------------------------------

def job_figure(job: JobView) -> bytes | None:
    """One PNG: loss across attempts (top), peak memory and throughput per attempt (bottom)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    colors = [c for c in plt.rcParams["axes.prop_cycle"].by_key()["color"] if c != "#d62728"]  # red: failures
    fig = plt.figure(figsize=(11, 7.5), dpi=100, layout="constrained")
    gs = fig.add_gridspec(2, 2, height_ratios=[1.4, 1])
    _loss_panel(fig.add_subplot(gs[0, :]), job, colors)
    _memory_panel(fig.add_subplot(gs[1, 0]), job)
    _throughput_panel(fig.add_subplot(gs[1, 1]), job, colors)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _loss_panel(ax, job: JobView, colors: list[str]) -> None:
    """Loss on the global step axis, every attempt, each failure marked where it happened."""
    any_loss = False
    xmax = max([job.total_steps or 0, *(s for a in job.attempts for s, _ in a.losses),
                *(a.max_step or 0 for a in job.attempts)]) or 1
    ax.set_xlim(0, xmax * 1.02 + 0.5)
    for k, a in enumerate(job.attempts):
        c = colors[k % len(colors)]
        if a.losses:
            xs, ys = zip(*a.losses)
            ax.plot(xs, ys, marker="o", ms=3, lw=1.6, color=c,
                    label=f"attempt {a.number}" + (f" ({a.remedy})" if a.remedy else ""))
            any_loss = True
        if a.failed:
            x = a.max_step if a.max_step is not None else (a.resumed_from_step or 0)
            ax.axvline(x, color="#d62728", ls="--", lw=1.2)
            label = a.outcome.replace("_", " ").upper() if a.outcome.endswith("oom") else a.outcome
            follow = f"\n→ {a.next_remedy}" if a.next_remedy else (f"\n→ {a.decision}" if a.decision else "")
            right = x > 0.7 * xmax  # near the right edge: write to the left of the line
            ax.annotate(f"✕ {label} (att. {a.number}){follow}", xy=(x, 1), xycoords=("data", "axes fraction"),
                        xytext=(-4 if right else 4, -4 - 30 * (k % 3)), textcoords="offset points", va="top",
                        ha="right" if right else "left", fontsize=9, color="#d62728")
    ax.set_title(f"job {job.id} {job.name}: loss on the global step axis, all attempts")
    ax.set_xlabel("global step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if any_loss:
        ax.legend(loc="lower left", fontsize=9)
    else:
        ax.text(0.5, 0.5, job.log_note or "no loss logged", transform=ax.transAxes, ha="center")


def _memory_panel(axm, job: JobView) -> None:
    """Peak host (and GPU) memory per attempt against the limit it ran under."""
    names = [str(a.number) for a in job.attempts]
    host = [(a.peak_host or 0) / GiB for a in job.attempts]
    gpu = [(a.peak_gpu or 0) / GiB for a in job.attempts]
    has_gpu = any(gpu)
    w = 0.38 if has_gpu else 0.6
    pos = range(len(names))
    axm.bar([p - (w / 2 if has_gpu else 0) for p in pos], host, w, color="#1f77b4", label="peak host RSS")
    if has_gpu:
        axm.bar([p + w / 2 for p in pos], gpu, w, color="#9467bd", label="peak GPU (max over GPUs)")
    for p, a in zip(pos, job.attempts):
        if a.host_limit:
            axm.hlines(a.host_limit / GiB, p - 0.45, p + (0 if has_gpu else 0.45), colors="#d62728", lw=2)
        if a.gpu_capacity and has_gpu:
            axm.hlines(a.gpu_capacity / GiB, p, p + 0.45, colors="#ff7f0e", lw=2)
    axm.plot([], [], color="#d62728", lw=2, label="host limit")
    if has_gpu:
        axm.plot([], [], color="#ff7f0e", lw=2, label="GPU capacity")
    axm.set_xticks(list(pos), names)
    axm.set_xlabel("attempt")
    axm.set_ylabel("GiB")
    axm.set_title("peak memory per attempt against the limit")
    axm.legend(fontsize=8, loc="lower right")
    axm.grid(alpha=0.3, axis="y")


def _throughput_panel(axt, job: JobView, colors: list[str]) -> None:
    names = [str(a.number) for a in job.attempts]
    pos = range(len(names))
    use_tokens = any(a.tokens_per_s for a in job.attempts)
    vals = [(a.tokens_per_s if use_tokens else a.steps_per_s) or 0 for a in job.attempts]
    bars = axt.bar(list(pos), vals, 0.6, color=[colors[k % len(colors)] for k in range(len(names))])
    for b, v in zip(bars, vals):
        axt.annotate(f"{v:,.0f}" if use_tokens and v else (f"{v:.2f}" if v else "n/a"),
                     (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    axt.set_xticks(list(pos), names)
    axt.set_xlabel("attempt")
    axt.set_ylabel("tokens/s" if use_tokens else "steps/s")
    axt.set_title("throughput per attempt")
    axt.grid(alpha=0.3, axis="y")


# Goodput buckets, in the order they stack (kept work first, then the cost of failures, then waits).
BUCKET_COLORS = {
    "productive": "#2ca02c", "checkpoint_save": "#9467bd", "emergency_save": "#c5b0d5", "checkpoint_load": "#1f77b4",
    "startup": "#aec7e8",
    "redone": "#ff7f0e", "failed": "#d62728", "hang": "#8c1c13", "backoff": "#e7ba52", "waiting_gpus": "#7f7f7f",
    "queued": "#c7c7c7", "held": "#525252",
}


def goodput_rows(night: Night) -> list[tuple[str, Any]]:
    """(label, Breakdown) per job with a breakdown, then the night's total."""
    rows = [(f"job {j.id} {j.name}", j.goodput.total) for j in night.jobs if j.goodput is not None]
    if rows:
        rows.append(("night (all jobs)", night.goodput))
    return rows


def night_figure(night: Night) -> bytes | None:
    """One stacked bar per job and one for the night: the share of wall time in each bucket."""
    rows = [(label, b) for label, b in goodput_rows(night) if b.wall_s > 0]
    if not rows:
        return None
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from supervisor.judge.goodput import LABELS

    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.55 * len(rows)), dpi=100, layout="constrained")
    ys = list(range(len(rows)))[::-1]
    used = set()
    for y, (_label, b) in zip(ys, rows):
        left = 0.0
        for bucket, color in BUCKET_COLORS.items():
            share = b.buckets.get(bucket, 0.0) / b.wall_s
            if share <= 0:
                continue
            ax.barh(y, share * 100, left=left, color=color, edgecolor="white", linewidth=0.5, height=0.62,
                    label=LABELS[bucket] if bucket not in used else None)
            if share >= 0.07:
                ax.text(left + share * 50, y, f"{share:.0%}", ha="center", va="center", fontsize=8,
                        color="white" if bucket in ("productive", "failed", "hang", "held", "checkpoint_load",
                                                     "checkpoint_save", "waiting_gpus") else "#222")
            used.add(bucket)
            left += share * 100
    ax.set_yticks(ys, [f"{label}\n{_dur(b.wall_s)}, goodput {b.goodput or 0:.0%}" for label, b in rows], fontsize=9)
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of wall time (%)")
    ax.set_title("where the time went: productive training / wall time = goodput")
    if len(rows) > 1:
        ax.axhline(ys[-1] + 0.5, color="#333", lw=0.8)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(rows) < 4 else -0.15), ncol=6, fontsize=8,
              frameon=False)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def goodput_table(night: Night) -> list[list[str]]:
    from supervisor.judge.goodput import BUCKETS, LABELS

    rows = goodput_rows(night)
    used = [b for b in BUCKETS if any(bd.buckets.get(b, 0) >= 0.5 for _, bd in rows)]
    head = ["", "wall time", "goodput", *(LABELS[b] for b in used)]
    return [head] + [[label, _dur(b.wall_s), "-" if b.goodput is None else f"{b.goodput:.1%}",
                      *(_dur(b.buckets.get(x, 0.0)) for x in used)] for label, b in rows]


# --- rendering -------------------------------------------------------------------------------

def _ts(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "-"


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    s = round(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _gib(b: int | None) -> str:
    return "-" if not b else f"{b / GiB:.2f} GiB"


def _rate(a: AttemptView) -> str:
    if a.tokens_per_s:
        return f"{a.tokens_per_s:,.0f} tok/s"
    return f"{a.steps_per_s:.2f} steps/s" if a.steps_per_s else "-"


def night_rows(night: Night) -> list[list[str]]:
    # Goodput, not "time in failed attempts": that figure (the failed attempts' wall time) read as a
    # second, different value of the buckets' "failed attempts" right below; the wall time is the
    # buckets' too (from submission).
    head = ["job", "name", "state", "attempts", "OOMs", "remedies", "progress", "wall time", "goodput",
            "steps lost"]
    rows = [head]
    for j in night.jobs:
        prog = "-" if j.last_step is None else f"{j.last_step}" + (f"/{j.total_steps}" if j.total_steps else "")
        ratio = j.goodput.total.goodput if j.goodput is not None else None
        wall = j.goodput.total.wall_s if j.goodput is not None else j.wall_s  # from submission, as below
        rows.append([str(j.id), j.name, j.state, str(len(j.attempts)), str(j.ooms),
                     ", ".join(j.remedies) or "-", prog, _dur(wall), "-" if ratio is None else f"{ratio:.1%}",
                     str(j.steps_lost)])
    return rows


def attempt_rows(job: JobView) -> list[list[str]]:
    rows = [["#", "started", "duration", "ran with", "resumed at", "reached", "outcome", "then",
             "steps lost", "emergency save", "peak host / limit", "peak GPU", "throughput"]]
    for a in job.attempts:
        then = a.next_remedy or a.decision or "-"
        rows.append([str(a.number), _ts(a.started_at), _dur(a.duration_s), a.remedy or "as submitted",
                     "-" if a.resumed_from_step is None else f"step {a.resumed_from_step}",
                     "-" if a.max_step is None else f"step {a.max_step}", a.outcome, then,
                     "-" if not a.failed or a.steps_lost is None else str(a.steps_lost), _emergency(a.emergency),
                     f"{_gib(a.peak_host)} / {_gib(a.host_limit)}", _gib(a.peak_gpu), _rate(a)])
    return rows


def _emergency(e: dict | None) -> str:
    """'step 7 in 0.6 s, OOM on rank 1 of 2 (node-b)'; 'none (not_attempted)'; '-' when the hook said nothing."""
    if not e:
        return "-"
    if e.get("outcome") == "saved":
        took = e.get("seconds")
        out = f"step {e.get('step')}" + (f" in {took:g} s" if isinstance(took, int | float) else "")
    elif e.get("outcome") == "already_saved":
        out = f"step {e.get('step')} (the regular save)"
    else:
        out = f"none ({e.get('outcome')})"
    if e.get("oom_rank") is not None:
        out += f", OOM on rank {e['oom_rank']}" + (f" of {e['world_size']}" if e.get("world_size") else "")
    if e.get("node"):
        out += f" ({e['node']})"
    return out


def outage_lines(night: Night) -> list[str]:
    """Per job, the failures of the surroundings (DNS, the hub, a proxy, a node) and the waits they
    led to (issue 29): a job waiting for the network is not a job failing."""
    out = []
    for j in night.jobs:
        env = [a for a in j.attempts if a.outcome == "environment"]
        if not env:
            continue
        waits = [a for a in env if a.decision == "wait"]
        line = (f"job {j.id} {j.name}: {len(env)} environment failure(s) (attempt "
                + ", ".join(str(a.number) for a in env) + f"), {len(waits)} wait(s) for the surroundings")
        last = j.attempts[-1]
        if last in env and j.state in ("waiting_retry", "failed") and j.reason:
            line += f"; {'now' if j.state == 'waiting_retry' else 'failed'}: {j.reason}"
        elif last not in env and last.outcome == "success":
            line += f"; the surroundings came back: attempt {last.number} succeeded"
        out.append(line)
    return out


def _md_table(rows: list[list[str]]) -> str:
    esc = [[markdown_cell(c) for c in r] for r in rows]
    lines = ["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(esc[0])]
    lines += ["| " + " | ".join(r) + " |" for r in esc[1:]]
    return "\n".join(lines)


def _html_table(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _title(night: Night) -> str:
    span = f"since {_ts(night.since)}" if night.since else "all jobs"
    return f"oom-supervisor: the night on {night.host} ({span})"


def render_markdown(night: Night, images: dict[int, str]) -> str:
    """Every piece of text from the record or the logs goes through `markdown_text`: a job name
    or a quoted log line must read as itself, never as HTML, a link or a tracking image."""
    md = markdown_text
    out = [f"# {md(_title(night))}", "", f"Generated {_ts(night.generated_at)}.", "", "## The night", "",
           _md_table(night_rows(night)), ""]
    if goodput_rows(night):
        out += ["## Where the time went", ""]
        if NIGHT_IMAGE in images.values():
            out += [f"![where the time went]({NIGHT_IMAGE})", ""]
        out += [_md_table(goodput_table(night)), ""]
    outages = outage_lines(night)
    if outages:
        out += ["## Outages of the surroundings", "",
                *(f"- {md(o)}" for o in outages), ""]
    for j in night.jobs:
        out += [f"## Job {j.id}: {md(j.name)} ({md(j.state)})", ""]
        if j.reason:
            out += [md(j.reason), ""]
        if j.id in images:
            out += [f"![job {j.id}]({images[j.id]})", ""]
        elif j.log_note:
            out += [f"_{md(j.log_note)}_", ""]
        out += [_md_table(attempt_rows(j)), ""]
        for a in j.attempts:
            if a.failed:
                out.append(f"- attempt {a.number}: **{md(a.outcome)}** - {md(a.summary)}"
                           + (f" -> next: {md(a.next_remedy)}" if a.next_remedy else ""))
        out.append("")
    return "\n".join(out)


CSS = """body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1180px}
table{border-collapse:collapse;margin:8px 0 16px;font-size:13px}th,td{border:1px solid #ccc;padding:4px 8px;
text-align:left}th{background:#f0f3f7}h1{font-size:22px}h2{font-size:18px;border-bottom:2px solid #1f77b4}
.failed{color:#b00}img{max-width:100%;border:1px solid #ddd}.muted{color:#777}"""


def render_html(night: Night, pngs: dict[int, bytes]) -> str:
    parts = [(f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(_title(night))}</title>"
              f"<style>{CSS}</style></head><body>"), f"<h1>{html.escape(_title(night))}</h1>",
             f"<p class='muted'>Generated {html.escape(_ts(night.generated_at))}.</p>",
             "<h2>The night</h2>", _html_table(night_rows(night))]
    if goodput_rows(night):
        parts.append("<h2>Where the time went</h2>")
        if NIGHT_KEY in pngs:
            b64 = base64.b64encode(pngs[NIGHT_KEY]).decode()
            parts.append(f"<img alt='where the time went' src='data:image/png;base64,{b64}'>")
        parts.append(_html_table(goodput_table(night)))
    outages = outage_lines(night)
    if outages:
        parts.append("<h2>Outages of the surroundings</h2><ul>" + "".join(
            f"<li>{html.escape(o)}</li>" for o in outages) + "</ul>")
    if not night.jobs:
        parts.append("<p>No jobs in this period.</p>")
    for j in night.jobs:
        parts.append(f"<h2>Job {j.id}: {html.escape(j.name)} ({html.escape(j.state)})</h2>")
        if j.reason:
            parts.append(f"<p>{html.escape(j.reason)}</p>")
        if j.id in pngs:
            b64 = base64.b64encode(pngs[j.id]).decode()
            parts.append(f"<img alt='job {j.id}' src='data:image/png;base64,{b64}'>")
        elif j.log_note:
            parts.append(f"<p class='muted'>{html.escape(j.log_note)}</p>")
        parts.append(_html_table(attempt_rows(j)))
        fails = [a for a in j.attempts if a.failed]
        if fails:
            parts.append("<ul>" + "".join(
                f"<li class='failed'>attempt {a.number}: <b>{html.escape(a.outcome)}</b> - "
                f"{html.escape(a.summary)}" + (f" &rarr; next: {html.escape(a.next_remedy)}" if a.next_remedy else "")
                + "</li>" for a in fails) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(night: Night, out_dir: Path) -> tuple[Path, Path]:
    """report.html (self-contained) and report.md (+ job-N.png) in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs, images = {}, {}
    png = night_figure(night)
    if png is not None:
        pngs[NIGHT_KEY] = png
        (out_dir / NIGHT_IMAGE).write_bytes(png)
        images[NIGHT_KEY] = NIGHT_IMAGE
    for j in night.jobs:
        png = job_figure(j)
        if png is not None:
            pngs[j.id] = png
            name = f"job-{j.id}.png"
            (out_dir / name).write_bytes(png)
            images[j.id] = name
    if night.jobs and not (set(pngs) - {NIGHT_KEY}):
        for j in night.jobs:  # say why there is no picture rather than leaving a hole
            j.log_note = j.log_note or "no plots: matplotlib is not installed (pip install 'oom-supervisor[report]')"
    html_path, md_path = out_dir / "report.html", out_dir / "report.md"
    html_path.write_text(render_html(night, pngs), encoding="utf-8")
    md_path.write_text(render_markdown(night, images), encoding="utf-8")
    return html_path, md_path
