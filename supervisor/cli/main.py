"""`oom-supervisor` command line.

Exit codes: 0 ok, 1 failure (e.g. the job failed, the daemon could not run),
2 usage or bad input (a refused job file, an unknown job).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=Path, help="state folder (env OOM_SUPERVISOR_STATE_DIR)")
    p.add_argument("--spool-dir", type=Path, help="spool folder (env OOM_SUPERVISOR_SPOOL_DIR)")
    p.add_argument("--config", type=Path, help="daemon config file (env OOM_SUPERVISOR_CONFIG)")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with `command`, `explain` and `plan` get their own arguments only when it is
    theirs: their modules import the diagnosis and the policy (~0.3 s of CPU), which every `status`
    or `show` would otherwise pay (a script polling `status` pays it on each call)."""
    parser = argparse.ArgumentParser(
        prog="oom-supervisor",
        description="Run fine-tuning jobs unattended: diagnose OOMs and other failures, remedy, resume.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("daemon", help="run the supervisor in the foreground (what systemd runs)")
    _common(p)
    p.add_argument("--json-logs", action="store_true", default=None, help="JSON log lines even on a TTY")
    p.add_argument("--mode", choices=("system", "single-user"),
                   help="system: each job runs as the user who submitted it (needs root: the system unit); "
                        "single-user (default): jobs run as the daemon's user (config key `mode`)")

    p = sub.add_parser("submit", help="validate a job file and put it in the spool")
    _common(p)
    p.add_argument("file", type=Path)
    p.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                   help="wait up to SECONDS for the daemon to accept it and print the job id "
                        "(default: 30 when a daemon runs on this state folder, else 0)")
    p.add_argument("--after", type=int, action="append", default=[], metavar="JOB",
                   help="start only once job JOB has succeeded (repeatable)")

    p = sub.add_parser("status", help="one line per job")
    _common(p)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("show", help="a job's full timeline: attempts, exits, diagnoses, decisions")
    _common(p)
    p.add_argument("job", type=int)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("logs", help="print an attempt's log")
    _common(p)
    p.add_argument("job", type=int)
    p.add_argument("--attempt", type=int, help="attempt number (default: the latest)")
    p.add_argument("-f", "--follow", action="store_true", help="keep following until the job ends")

    p = sub.add_parser("watch", help="a live view of one job until it ends")
    _common(p)
    p.add_argument("job", type=int)
    p.add_argument("--interval", type=float, default=1.0)

    for name, helptext in (("cancel", "cancel a job (stops its attempt if running)"),
                           ("retry", "queue a failed, cancelled or waiting job again now")):
        p = sub.add_parser(name, help=helptext)
        _common(p)
        p.add_argument("job", type=int)

    p = sub.add_parser("unpause", help="resume scheduling after the queue was paused (e.g. disk full)")
    _common(p)

    p = sub.add_parser("explain", help="diagnose any log file")
    if command in (None, "explain"):
        from supervisor.cli import explain

        explain.configure(p)

    p = sub.add_parser("plan", help="show the remedy ladder a job would climb, without running it")
    _common(p)
    if command in (None, "plan"):
        from supervisor.cli import plan

        plan.configure(p)

    p = sub.add_parser("report", help="the morning report: an HTML page with plots and a Markdown summary")
    _common(p)
    p.add_argument("jobs", nargs="*", type=int, metavar="JOB", help="only these jobs (default: recent ones)")
    p.add_argument("--since", default="12h", help="jobs active in this period (default 12h; ignored with JOB)")
    p.add_argument("-o", "--output", type=Path, default=Path("oom-supervisor-report"), metavar="DIR",
                   help="folder for report.html, report.md and the PNGs (default ./oom-supervisor-report)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return EXIT_FAIL
    except BrokenPipeError:
        return EXIT_OK


def _config(args: argparse.Namespace):
    from supervisor.daemon.config import ConfigError, load_config

    try:
        return load_config(getattr(args, "config", None), state_dir=getattr(args, "state_dir", None),
                           spool_dir=getattr(args, "spool_dir", None), mode=getattr(args, "mode", None))
    except ConfigError as exc:
        print(f"oom-supervisor: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


def no_state_message(cfg) -> str:
    """What `status`, `show` and the others say when the state folder has no record: the same
    words, and where the state the user most likely means is (the demo's, run from this folder)."""
    msg = f"no state at {cfg.state.root} (has the daemon run with this --state-dir?)"
    demo = Path(".demo/state").resolve()
    if (demo / "state.sqlite3").exists() and demo != cfg.state.root:
        msg += (f"; the demo's state is {demo}: add `--state-dir {demo}`, or "
                f"`export OOM_SUPERVISOR_STATE_DIR={demo} OOM_SUPERVISOR_SPOOL_DIR={demo.parent / 'spool'}`")
    return msg


def _remote(cfg):
    """The control socket when this user cannot read the record (a shared box: the state is root's);
    None when they can, and the record is read directly, as root or a single-user daemon's user."""
    from supervisor.cli.remote import Remote, can_read_record

    if can_read_record(cfg.state):
        return None
    if cfg.control_socket is None:
        print(f"oom-supervisor: cannot read {cfg.state.root} and no control_socket is configured", file=sys.stderr)
        raise SystemExit(EXIT_FAIL)
    return Remote(cfg.control_socket)


def _call(remote, op: str, **args):
    """One request to the daemon; its refusal (not your job, no such job) is said and exits."""
    from supervisor.cli.remote import RemoteError

    try:
        return remote.call(op, **args)
    except RemoteError as exc:
        print(f"oom-supervisor: {exc}", file=sys.stderr)
        raise SystemExit(exc.code) from None


def _say(reply) -> int:
    """A record/requests.Reply (or its dict from the socket), printed where it belongs."""
    r = reply if isinstance(reply, dict) else {"code": reply.code, "message": reply.message, "error": reply.error}
    print(r["message"], file=sys.stderr if r["error"] else sys.stdout)
    return r["code"]


def _store(cfg, *, must_exist: bool = True):
    from supervisor.record.store import Store

    if must_exist and not cfg.state.db.exists():
        print(f"oom-supervisor: {no_state_message(cfg)}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)
    return Store(cfg.state.db)


# --- commands ----------------------------------------------------------------------------

def cmd_daemon(args) -> int:
    from supervisor.daemon.loop import Daemon, DaemonLocked
    from supervisor.daemon.system import NotRoot
    from supervisor.service.logsetup import configure

    configure(json=True if args.json_logs else None)
    cfg = _config(args)
    try:
        return Daemon(cfg).run()
    except (DaemonLocked, NotRoot) as exc:
        print(f"oom-supervisor: {exc}", file=sys.stderr)
        return EXIT_FAIL


def cmd_submit(args) -> int:
    """Exit 2 with one paragraph for anything wrong with the file or the spool; never a
    traceback, never a hang (parsing is bounded, FIFOs are not opened for reading)."""
    from supervisor.intake.jobspec import JobFileError
    from supervisor.intake.spool import CheckContext, display_name, submit

    cfg = _config(args)
    shown = display_name(str(args.file))
    try:
        text = _read_job_file(args.file, cfg.max_job_file_bytes)
    except _Refused as exc:
        print(f"oom-supervisor: {shown}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    checked: list = []
    try:
        if args.after:
            from supervisor.intake.spool import with_after

            text = with_after(text, args.after)
        context = CheckContext(daemon_env=dict(cfg.env), launch_here=cfg.backend != "slurm")
        dest = submit(cfg.spool, text, name=Path(args.file).name, cwd=Path.cwd(),
                      policy_dirs=cfg.policy_search_dirs(), context=context, state=cfg.state, checked_out=checked)
    except JobFileError as err:
        print(err.report(), file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        where = display_name(exc.filename) if getattr(exc, "filename", None) else str(cfg.spool.incoming)
        print(f"oom-supervisor: cannot write the job into the spool {cfg.spool.incoming}: {where}: "
              f"{exc.strerror or exc} ({_why_unwritable(exc)}); nothing was submitted", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - a bug of ours must still not print a traceback at the user
        print(f"oom-supervisor: {shown} could not be checked ({type(exc).__name__}: {str(exc)[:200]}); "
              "nothing was submitted", file=sys.stderr)
        return EXIT_USAGE
    for c in checked:
        for w in c.warnings:
            print(f"warning: {w}", file=sys.stderr)
        for n in c.notes:
            print(f"note: {n}", file=sys.stderr)
    print(f"submitted {shown} (spool file {dest.name})")
    wait = args.wait
    alive = _daemon_pid(cfg)
    if alive is None and _remote(cfg) is not None:  # a shared box: the record is root's, its socket says
        alive = cfg.control_socket.exists() or None
    if wait is None:
        wait = 30.0 if alive else 0.0
    if wait > 0:
        return _wait_accepted(cfg, dest, wait)
    if alive is None:
        print(f"no daemon runs on {cfg.state.root} now: the job gets its id when one starts "
              f"(`oom-supervisor daemon`, with the same --state-dir/--spool-dir)")
    return EXIT_OK


def _daemon_pid(cfg) -> int | None:
    """The pid of a daemon holding this state folder, read from its lock file (never locking it)."""
    import os

    try:
        pid = int(cfg.state.lock.read_text().strip() or 0)
    except (OSError, ValueError):
        return None
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"daemon" not in f.read():
                return None  # the pid was reused by something else
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid


class _Refused(Exception):
    pass


def _read_job_file(path: Path, max_bytes: int) -> str:
    """The job file's text; _Refused saying why it cannot be one."""
    import errno
    import os
    import stat as stat_mod

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO must not block
    except FileNotFoundError:
        raise _Refused("no such file") from None
    except OSError as exc:
        raise _Refused(f"cannot be opened: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            raise _Refused("not a regular file")
        if st.st_size > max_bytes:
            raise _Refused(f"is {st.st_size} bytes; job files are limited to {max_bytes} bytes")
        data = b""
        while len(data) <= max_bytes:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            data += chunk
        if len(data) > max_bytes:
            raise _Refused(f"is larger than {max_bytes} bytes (it grew while being read)")
    except OSError as exc:
        raise _Refused(f"cannot be read: {errno.errorcode.get(exc.errno, '')} {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Refused(f"is not UTF-8 text (byte {exc.start}); job files are YAML text") from None


def _why_unwritable(exc: OSError) -> str:
    import errno

    return {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exhausted",
            errno.EROFS: "the file system is read-only", errno.EACCES: "no permission to write there",
            errno.EPERM: "no permission to write there", errno.EEXIST: "a file is in the way of a folder",
            errno.ENOTDIR: "a file is in the way of a folder"}.get(exc.errno, "check the spool folder")


def _wait_accepted(cfg, dest: Path, wait_s: float) -> int:
    deadline = time.monotonic() + wait_s
    rejected = cfg.spool.rejected / (dest.name + ".error.txt")
    remote = _remote(cfg)
    while time.monotonic() < deadline:
        if remote is not None:
            found = _call(remote, "find", source=dest.name)["job"]
            if found is not None:
                print(f"job {found}")
                return EXIT_OK
        elif cfg.state.db.exists():
            store = _store(cfg)
            row = store.conn.execute("SELECT id FROM jobs WHERE source=?", (dest.name,)).fetchone()
            store.close()
            if row:
                print(f"job {row[0]}")
                return EXIT_OK
        if rejected.exists():
            print(rejected.read_text(errors="replace"), file=sys.stderr)
            return EXIT_USAGE
        time.sleep(0.2)
    print("oom-supervisor: the daemon has not picked it up yet (is it running?)", file=sys.stderr)
    return EXIT_FAIL


def cmd_status(args) -> int:
    from supervisor.cli.timeline import job_summary

    cfg = _config(args)
    remote = _remote(cfg)
    if remote is not None:  # every job's id, owner, name and state; the rest of the caller's own
        answer = _call(remote, "status")
        rows, paused = answer["jobs"], answer["paused"]
    elif not cfg.state.db.exists():
        print("[]" if args.json else f"no jobs yet: {no_state_message(cfg)}")
        return EXIT_OK
    else:
        store = _store(cfg)
        rows = [job_summary(store, j) for j in store.jobs()]
        paused = store.get_meta("queue_paused")
        store.close()
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from supervisor.cli.show import clean

    # Names and reasons are untrusted (job files, logs): Text, never markup, no control codes.
    rows, paused = clean(rows), clean(paused)
    console = Console(highlight=False)
    wide = console.width >= 120
    table = Table(box=None, pad_edge=False)
    owners = any(r.get("owner") for r in rows)  # a shared box: say whose each job is (like squeue)
    for col in ("ID", *(("OWNER",) if owners else ()), "NAME", "STATE", "ATT", "PROGRESS", "LAST", "REMEDY"):
        # Short fixed words stay whole; the rest wrap rather than being cut at 80 columns.
        table.add_column(col, no_wrap=col in ("ID", "STATE", "ATT"), overflow="fold")
    if wide:
        table.add_column("WHY", overflow="fold")
    for r in rows:
        cells = [str(r["id"]), *((r.get("owner") or "-",) if owners else ()), r["name"], r["state"],
                 str(r["attempts"]), r.get("progress") or "-", r.get("last") or r.get("last_diagnosis") or "-", r.get("remedy") or "-"]
        table.add_row(*(Text(str(c)) for c in cells), *([Text(r.get("reason") or "")] if wide else []))
    if paused:
        line = Text("queue paused", style="bold red")
        line.append(f": {paused} (fix it, then `oom-supervisor unpause`)")
        console.print(line)
    console.print(table if rows else Text("no jobs yet"))
    if not wide:  # reasons on their own lines rather than cropped into a narrow column
        for r in rows:
            if r.get("reason"):
                console.print(Text(f"  {r['id']}: {r['reason']}"))
    return EXIT_OK


def _job_or_exit(store, job_id: int):
    job = store.job(job_id)
    if job is None:
        print(f"oom-supervisor: no job {job_id}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)
    return job


def cmd_show(args) -> int:
    from supervisor.cli.timeline import job_timeline

    cfg = _config(args)
    remote = _remote(cfg)
    if remote is not None:
        data = _call(remote, "show", job=args.job)
    else:
        store = _store(cfg)
        _job_or_exit(store, args.job)
        data = job_timeline(store, args.job)
        store.close()
    if args.json:
        print(json.dumps(data, indent=2, default=str))
        return EXIT_OK
    from supervisor.cli.show import print_timeline

    print_timeline(data)
    return EXIT_OK


def cmd_logs(args) -> int:
    cfg = _config(args)
    remote = _remote(cfg)
    if remote is not None:
        return _remote_logs(remote, args)
    store = _store(cfg)
    job = _job_or_exit(store, args.job)
    last = store.last_attempt(args.job)
    number = args.attempt or (last.number if last else None)
    if number is None:
        print(f"oom-supervisor: job {args.job} has no attempts yet", file=sys.stderr)
        return EXIT_USAGE
    path = cfg.state.job(args.job).attempt(number).log
    if not path.exists():
        print(f"oom-supervisor: no log for job {args.job} attempt {number}", file=sys.stderr)
        return EXIT_USAGE
    out = sys.stdout.buffer
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 16)
            if chunk:
                out.write(chunk)
                out.flush()
                continue
            if not args.follow:
                break
            job = store.job(args.job)
            latest = store.last_attempt(args.job)
            if job.state.terminal or (latest and latest.number != number and not args.attempt):
                if latest and latest.number != number and not job.state.terminal:
                    number = latest.number
                    f.close()
                    return _follow_next(args, store, cfg, number)
                break
            time.sleep(0.5)
    store.close()
    return EXIT_OK


def _follow_next(args, store, cfg, number):
    store.close()
    print(f"\n--- attempt {number} ---", flush=True)
    ns = argparse.Namespace(**{**vars(args), "attempt": None})
    return cmd_logs(ns)


def _remote_logs(remote, args) -> int:
    """`logs` through the daemon: chunks by offset; with -f, on to the next attempt until the end."""
    import base64

    number, offset = args.attempt, 0
    out = sys.stdout.buffer
    while True:
        got = _call(remote, "logs", job=args.job, attempt=number, offset=offset)
        number = got["attempt"]
        data = base64.b64decode(got["data"])
        if data:
            out.write(data)
            out.flush()
            offset = got["offset"]
            continue
        if not args.follow:
            return EXIT_OK
        if got["latest"] != number and not args.attempt:
            number, offset = got["latest"], 0
            print(f"\n--- attempt {number} ---", flush=True)
            continue
        if got["terminal"]:
            return EXIT_OK
        time.sleep(0.5)


def cmd_watch(args) -> int:
    from supervisor.cli.show import watch

    cfg = _config(args)
    remote = _remote(cfg)
    if remote is not None:
        import base64

        def fetch():
            data = _call(remote, "show", job=args.job)
            tail = b""
            if data["attempt_list"]:
                tail = base64.b64decode(_call(remote, "logs", job=args.job, tail=8192)["data"])
            return data, tail
        return watch(cfg, args.job, interval=args.interval, fetch=fetch)
    store = _store(cfg)
    _job_or_exit(store, args.job)
    store.close()
    return watch(cfg, args.job, interval=args.interval)


def _request(args, op: str) -> int:
    """cancel / retry / unpause: the same durable intent, written here or by the daemon for us."""
    from supervisor.record import requests

    cfg = _config(args)
    remote = _remote(cfg)
    job = {"job": args.job} if op != "unpause" else {}
    if remote is not None:
        return _say(_call(remote, op, **job))
    import pwd

    try:  # the record says who asked, as the control socket does from SO_PEERCRED
        who: str | None = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        who = f"uid {os.getuid()}"
    store = _store(cfg)
    try:
        return _say(getattr(requests, op)(store, *job.values(), who=who))
    finally:
        store.close()


def cmd_cancel(args) -> int:
    return _request(args, "cancel")


def cmd_retry(args) -> int:
    return _request(args, "retry")


def cmd_unpause(args) -> int:
    return _request(args, "unpause")


def cmd_explain(args) -> int:
    from supervisor.cli import explain

    return explain.run(args)


def cmd_plan(args) -> int:
    from supervisor.cli import plan
    from supervisor.daemon.config import ConfigError, load_config

    # The state folder's observations.sqlite3 gives the learned prediction; a plan needs no daemon,
    # so a configuration that cannot be read only means planning without them.
    try:
        from supervisor.cli.remote import can_read_record

        cfg = load_config(getattr(args, "config", None), state_dir=getattr(args, "state_dir", None),
                          spool_dir=getattr(args, "spool_dir", None))
        # A shared box's observations are in the root-only state folder: plan without them there.
        args.state_root = cfg.state.root if can_read_record(cfg.state) else None
    except ConfigError as exc:
        print(f"warning: {exc}; planning without learned observations", file=sys.stderr)
        args.state_root = None
    return plan.run(args)


def cmd_report(args) -> int:
    from supervisor.intake.jobspec import parse_duration
    from supervisor.service.report import collect, write_report

    try:
        since = time.time() - parse_duration(args.since)
    except ValueError as exc:
        print(f"oom-supervisor: --since: {exc}", file=sys.stderr)
        return EXIT_USAGE
    cfg = _config(args)
    if _remote(cfg) is not None:
        print(f"oom-supervisor: report reads the whole record and every job's training log: run it as root "
              f"(sudo oom-supervisor report ...); {cfg.state.root} is root's alone", file=sys.stderr)
        return EXIT_FAIL
    store = _store(cfg)
    for job_id in args.jobs:
        _job_or_exit(store, job_id)
    night = collect(store, cfg.state, args.jobs or None, since=None if args.jobs else since)
    store.close()
    html_path, md_path = write_report(night, args.output)
    print(f"{html_path}\n{md_path}\n({len(night.jobs)} job(s))")
    return EXIT_OK


COMMANDS = {
    "daemon": cmd_daemon, "submit": cmd_submit, "status": cmd_status, "show": cmd_show,
    "logs": cmd_logs, "watch": cmd_watch, "cancel": cmd_cancel, "retry": cmd_retry,
    "unpause": cmd_unpause, "explain": cmd_explain, "plan": cmd_plan, "report": cmd_report,
}

if __name__ == "__main__":
    sys.exit(main())
