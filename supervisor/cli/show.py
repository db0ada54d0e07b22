"""Human views of the record: `show` (the night, attempt by attempt) and `watch` (live).

Everything shown here comes from job files and training logs, so it is untrusted:
it is always rendered as `rich.text.Text`, never parsed as markup (a reason with
`[/bold]` crashed rich; `[rank1]` vanished)."""

from __future__ import annotations

import datetime as dt
import re
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.text import Text

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clean(obj: Any) -> Any:
    """`obj` with every string's control characters shown as escapes: an ESC from a
    training log must not drive the user's terminal (rich's Text keeps it)."""
    if isinstance(obj, str):
        return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", obj)
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def _ts(t: float | None) -> str:
    if not t:
        return "-"
    return dt.datetime.fromtimestamp(t).strftime("%H:%M:%S")


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _exit_text(e: dict | None) -> str:
    if not e:
        return "-"
    if e.get("returncode") is None:
        return "unknown"
    s = f"signal {e['signal']}" if e.get("signal") else f"exit {e['returncode']}"
    if e.get("stopped_by"):
        s += f" (stopped: {e['stopped_by']})"
    return s


def _secs(s: float) -> str:
    s = round(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def time_line(t: dict[str, Any] | None) -> str | None:
    """'2m05s = start-up 20s, productive 1m30s (72%), checkpoint saves 5s, ...' (goodput buckets)."""
    if not t or not t.get("wall_s"):
        return None
    from supervisor.judge.goodput import BUCKETS, LABELS

    wall = t["wall_s"]
    parts = [f"{LABELS[b]} {_secs(v)}" + (f" ({v / wall:.0%})" if b == "productive" else "")
             for b in BUCKETS if (v := (t.get("buckets") or {}).get(b) or 0) >= 0.5]
    return f"{_secs(wall)} = " + ", ".join(parts)


def attempt_panel(a: dict[str, Any]) -> Panel:
    lines = Text()
    dur = a.get("duration_s")
    lines.append(f"started {_ts(a['started_at'])}, ended {_ts(a['ended_at'])}"
                 + (f" ({dur:.0f}s)" if dur else "") + "\n")
    lines.append("remedy: ", style="bold")
    lines.append((a.get("remedy") or "none (the configuration as submitted)") + "\n")
    over = a.get("overrides") or {}
    if not a.get("changes_said"):  # else the previous attempt's decision listed them, old -> new
        for k, v in (over.get("yaml") or {}).items():
            lines.append(f"  yaml {k} = {v!r}\n")
        for k, v in (over.get("env") or {}).items():
            lines.append(f"  env  {k}={v}\n")
    if over.get("deepspeed"):
        lines.append("  deepspeed: generated config (see ds_config.json in the attempt folder)\n")
    if a.get("resumed_from"):
        lines.append(f"resumed from: {a['resumed_from']} (step {a.get('resumed_from_step')})\n")
    prog = a.get("max_step")
    if prog is not None:
        lines.append(f"reached step {prog}" + (f"/{a['total_steps']}" if a.get("total_steps") else ""))
        if a.get("steps_lost") is not None:
            lines.append(f", steps lost: {a['steps_lost']}")
        lines.append("\n")
    if a.get("emergency_checkpoint"):
        lines.append(a["emergency_checkpoint"] + "\n")
    spent = time_line(a.get("time"))
    if spent:
        lines.append("time: ", style="bold")
        lines.append(spent + "\n")
    rates = []
    if a.get("steps_per_s"):
        rates.append(f"{a['steps_per_s']:.3f} steps/s")
    if a.get("tokens_per_s"):
        rates.append(f"{a['tokens_per_s']:.0f} tokens/s")
    if rates or a.get("peak_host_memory_bytes"):
        by = f", by {a['peak_host_memory_measure']}" if a.get("peak_host_memory_measure") else ""
        lines.append(f"throughput: {', '.join(rates) or '-'}; peak host memory: "
                     f"{human_bytes(a.get('peak_host_memory_bytes'))}{by}\n")
    lines.append("exit: ", style="bold")
    lines.append(_exit_text(a.get("exit")) + "\n")
    d = a.get("diagnosis")
    if d:
        style = "green" if d["category"] == "success" else "red"
        lines.append("diagnosis: ", style="bold")
        lines.append(f"{d['category']}", style=style)
        extra = [x for x in (d.get("subkind"), d.get("vendor") if d.get("vendor") != "unknown" else None,
                             f"phase {d['phase']}" if d.get("phase") not in (None, "unknown") else None,
                             f"rank {d['rank']}" if d.get("rank") is not None else None) if x]
        if extra:
            lines.append(f" ({', '.join(extra)})")
        lines.append(f": {d.get('summary', '')}\n")
        if d["category"] == "unknown" and d.get("candidates"):  # nothing certain: where to look
            from supervisor.judge.diagnosis.candidates import candidates_line

            lines.append(f"  unknown; {candidates_line(d['candidates'])}\n")
        nums = {k: v for k, v in (d.get("numbers") or {}).items() if v is not None}
        if nums:
            shown = ", ".join(f"{k}={human_bytes(v) if isinstance(v, (int, float)) and k not in ('device_index', 'rank') and v > 4096 else v}"
                              for k, v in nums.items())
            lines.append(f"  numbers: {shown}\n")
        for ev in (d.get("evidence") or [])[:4]:
            lines.append(f"  line {ev['line_no']}: ", style="dim")
            lines.append(ev["text"][:200] + "\n", style="dim")
    dec = a.get("decision")
    if dec:
        lines.append("decision: ", style="bold")
        lines.append(f"{dec.get('kind')}" + (f" -> {dec['rung']}" if dec.get("rung") else ""))
        if dec.get("reason"):
            lines.append(f": {dec['reason']}")
        lines.append("\n")
        for c in dec.get("changes") or []:
            why = "" if c["why"] and c["why"] in (dec.get("reason") or "") else f"  ({c['why']})"
            lines.append(f"  {c['target']} {c['key']}: {c['old']!r} -> {c['new']!r}{why}\n")
    title = Text(f"attempt {a['number']}" + (" (interrupted)" if a.get("interrupted") else ""))
    return Panel(lines, title=title, title_align="left")


def print_timeline(data: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console(highlight=False)
    data = clean(data)
    head = Text()
    head.append(f"job {data['id']}", style="bold")
    head.append(f" {data['name']}" + (f"  owner: {data['owner']}" if data.get("owner") else "") + "  state: ")
    head.append(str(data["state"]), style="bold")
    head.append(f"  attempts: {data['attempts']}  workdir: {data['workdir']}")
    console.print(head)
    if data.get("reason"):
        console.print(Text(f"why: {data['reason']}"))
    g = data.get("goodput")
    if g and g.get("wall_s"):
        line = Text()
        line.append(f"goodput {g['goodput']:.0%}" if g.get("goodput") is not None else "goodput -", style="bold")
        line.append(f" (productive training / wall time): {time_line(g)}")
        console.print(line)
    prev_changes = False
    for a in data["attempt_list"]:
        console.print(attempt_panel({**a, "changes_said": prev_changes}))
        prev_changes = bool((a.get("decision") or {}).get("changes"))
    # Each decision is said once, in its attempt's panel: the events that repeat a panel's lines
    # (its start, its fatal line, its end and diagnosis, the state change its decision made) are not
    # listed again. Lines, not a table: a path is never cut in the middle at 80 columns.
    shown = [e for e in data["events"] if not _in_a_panel(e)]
    if shown:
        console.print(Text("events", style="bold"))
    for e in shown:
        line = Text(f"{_ts(e['ts'])} ")
        if e["attempt"]:
            line.append(f"[{e['attempt']}] ", style="dim")
        line.append(f"{e['kind']}: ", style="bold")
        line.append(str(e["message"]))
        console.print(line, overflow="fold")


_PANEL_EVENTS = ("attempt_started", "attempt_ended", "fatal_detected",
                 "attempt_timing")  # (raw marks for the goodput lines; in --json)


def _in_a_panel(e: dict[str, Any]) -> bool:
    if e["kind"] in _PANEL_EVENTS:
        return True
    msg = str(e["message"])
    return e["kind"] == "state" and msg.startswith(("running -> ", "waiting_retry -> running", "queued -> running",
                                                    "interrupted -> running"))


def watch(cfg, job_id: int, *, interval: float = 1.0, fetch=None) -> int:
    """Redraw the job's state, current attempt and log tail until it ends. `fetch` () -> (timeline,
    the log's last bytes): the control socket's, for a user who cannot read the record."""
    from supervisor.cli.timeline import job_timeline
    from supervisor.record.store import Store

    def local():
        store = Store(cfg.state.db)
        try:
            data = job_timeline(store, job_id)
        finally:
            store.close()
        tail = b""
        if data["attempt_list"]:
            tail = _last_bytes(cfg.state.job(job_id).attempt(data["attempt_list"][-1]["number"]).log)
        return data, tail

    console = Console(highlight=False)
    with Live(console=console, refresh_per_second=4, transient=False) as live:
        while True:
            data, raw = (fetch or local)()
            data, tail = clean(data), clean(_tail_lines(raw, 6))
            head = Text(f"job {job_id} {data['name']}: {data['state']}  attempt {data['attempts']}  "
                        f"{data.get('progress') or ''}  remedy: {data.get('remedy') or 'none'}\n", style="bold")
            if data.get("reason"):
                head.append(f"{data['reason']}\n", style="")
            live.update(Group(head, Panel(Text(tail), title="log tail", title_align="left")))
            if data["state"] in ("succeeded", "failed", "cancelled"):
                return 0 if data["state"] == "succeeded" else 1
            time.sleep(interval)


def _last_bytes(path, n: int = 8192) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read()
    except OSError:
        return b""


def _tail_lines(raw: bytes, n: int) -> str:
    data = raw.decode("utf-8", "replace")
    lines = [ln.rsplit("\r", 1)[-1] for ln in data.splitlines() if ln.strip()]
    return "\n".join(x[:160] for x in lines[-n:])
