"""The spool folder: how jobs get in.

`incoming/` receives job files (by `submit`, or a plain `cp`/`mv`). Everything in
it is hostile until proven otherwise: any name (non-UTF-8, 255 bytes), any type
(symlink, FIFO, folder), any content (alias bombs, 3000-deep nesting, huge numbers).

A daemon first claims a settled file by renaming it into `claimed/<state tag>/`:
only one rename wins, so two daemons sharing a spool never both take a file (so
`incoming/` must not be a mount point of its own: a rename cannot cross file systems). It
then accepts it by recording the job and copying it to `jobs/<id>/job.yaml` in one
SQLite transaction, and removes it. Each file carries a key (claimed name, inode,
mtime, size, content hash): if the daemon dies after the commit but before the
unlink, the next intake finds the key recorded and only removes the leftover, so a
crash can neither lose nor duplicate a job. Any error in one file rejects that
file: it goes to `rejected/` under a safe, bounded name with `<name>.error.txt`
saying what is wrong; intake never raises for a file. Each call works within a
budget of files and seconds and goes on at the next call.

Who submitted: the owner of the file, read with fstat on the file as opened (O_NOFOLLOW), and
recorded with the job. A single-user daemon takes only its own user's (and root's) files. On a
shared box (system mode, the daemon is root) only root and the members of the submit group may
submit, a file with other hard links is refused, its checks read the job's paths as its submitter,
and the folders are private: `incoming/` is 1730 root:<submit group> (members create files, nobody
lists or reads another's; `submit` writes them 0600), `rejected/` is 0711 (a refusal and its
reason are the submitter's, 0600, opened by name) and `claimed/` is root's alone.
"""

from __future__ import annotations

import errno
import hashlib
import heapq
import os
import re
import secrets
import shutil
import sqlite3
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from supervisor.core.models import Problem
from supervisor.core.paths import SpoolPaths, StatePaths
from supervisor.intake import facts as facts_mod
from supervisor.intake import preflight
from supervisor.intake.jobspec import (
    JobFileError,
    JobSpec,
    Partial,
    load_yaml_with_lines,
    parse_job_text,
)
from supervisor.record.store import Store
from supervisor.run.fsutil import atomic_write_text, fsync_dir
from supervisor.run.identity import SubmitGate, UnknownUser, acting_as, lookup, user_name

TEMP_SUFFIXES = (".tmp", ".part", ".partial", ".swp", "~")
SPOOL_FILE_MODE = 0o600  # a job file may hold tokens: its submitter's alone (the daemon is root)
INCOMING_MODE, REJECTED_MODE, PRIVATE_MODE = 0o1730, 0o711, 0o700
MAX_FILES_PER_CALL = 100
MAX_SECONDS_PER_CALL = 1.0
KEEP_REJECTED = 1000
REJECTED_MAX_AGE_S = 30 * 86400.0
_MAX_SAFE_NAME = 120  # bytes; leaves room for a collision suffix and ".error.txt"
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass
class IntakeResult:
    accepted: list[int] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)  # too young to read yet
    deferred: int = 0  # settled files left for the next call (budget spent)
    pruned: int = 0  # old rejected files removed


# Files with an mtime in the future, as seen by the previous call: (incoming, name) -> (ino, size, mtime_ns).
_future_seen: dict[tuple[str, str], tuple[int, int, int]] = {}
_last_prune: dict[str, float] = {}
_prepared: set[tuple[str, int | None]] = set()


def _is_temp_name(name: str) -> bool:
    return name.startswith(".") or name.endswith(TEMP_SUFFIXES) or name.endswith(".error.txt")


def display_name(name: str) -> str:
    """A printable, storable form of any file name: undecodable bytes and control
    characters become escapes (SQLite refuses the surrogates os.scandir gives them)."""
    text = os.fsencode(name).decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}"
                   for c in text)


def safe_name(name: str) -> str:
    """A short name any file system takes, recognisably derived from `name`."""
    shown = display_name(name)
    safe = _SAFE.sub("_", shown).lstrip(".") or "file"
    if safe == shown and len(safe.encode()) <= _MAX_SAFE_NAME:
        return safe
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:8]
    return f"{safe[:_MAX_SAFE_NAME - 9]}.{digest}"


def spool_key(name: str, st: os.stat_result, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()[:16]
    return f"{display_name(name)}:{st.st_ino}:{st.st_mtime_ns}:{st.st_size}:{digest}"


def _claimed_name(name: str, ino: int) -> str:
    if len(os.fsencode(name)) <= 200:
        return f"{ino}.{name}"
    return f"{ino}.~{hashlib.sha256(os.fsencode(name)).hexdigest()[:16]}"


def _original_of_claimed(cname: str) -> str:
    rest = cname.partition(".")[2]
    return f"(long name, hash {rest[1:]})" if rest.startswith("~") else rest


def intake(spool: SpoolPaths, state: StatePaths, store: Store, *, settle_s: float,
           max_bytes: int, now: float | None = None, log=None,
           max_files: int = MAX_FILES_PER_CALL, max_seconds: float = MAX_SECONDS_PER_CALL,
           policy_dirs: Sequence[Path] | None = None, keep_rejected: int = KEEP_REJECTED,
           rejected_max_age_s: float = REJECTED_MAX_AGE_S, context: CheckContext | None = None,
           gate: SubmitGate | None = None) -> IntakeResult:
    """Accept or reject settled files in incoming/ (oldest first), at most `max_files`
    of them or `max_seconds` per call; the rest wait for the next call. Files this
    daemon claimed before a crash are finished first. With `policy_dirs`, a job naming
    a policy not found there is refused. `context` says what the daemon's attempts will see
    (its environment, where they run) for the pre-launch checks; by default this process's.
    With `gate`, only the files of those it lets submit are jobs (on a shared box the spool's
    folders also get their private modes)."""
    context = context or CheckContext(where="intake")
    spool.ensure()
    state.ensure()
    if gate is not None and gate.shared:
        prepare_spool(spool, gate, log=log)
    now = time.time() if now is None else now
    deadline = time.monotonic() + max_seconds
    result = IntakeResult()
    claimed = spool.claimed(state.tag)
    claimed.mkdir(parents=True, exist_ok=True)
    budget = max(1, max_files)

    # 1. Our own claims left by a crash (or by a state-disk failure in an earlier call).
    leftovers = _list(claimed, limit=budget)
    for cname in leftovers:
        if budget <= 0 or time.monotonic() > deadline:
            result.deferred += 1
            continue
        budget -= 1
        if not _process(spool, state, store, claimed / cname, cname, _original_of_claimed(cname),
                        max_bytes, policy_dirs, result, log, context, gate):
            return result  # the state folder cannot take a job now; try again next call

    # 2. Settled files in incoming/, oldest first.
    for name, st in _candidates(spool.incoming, limit=budget * 4 + 16):
        if not _settled(spool, name, st, now, settle_s, log):
            result.waiting.append(name)
            continue
        if budget <= 0 or time.monotonic() > deadline:
            result.deferred += 1
            continue
        cname = _claimed_name(name, st.st_ino)
        try:
            os.rename(spool.incoming / name, claimed / cname)
        except FileNotFoundError:
            continue  # another daemon claimed it first
        except OSError as exc:
            if log:
                log.warning("spool_claim_failed", file=display_name(name), error=str(exc))
            continue
        budget -= 1
        if not _process(spool, state, store, claimed / cname, cname, name, max_bytes, policy_dirs,
                        result, log, context, gate):
            return result
    _forget_future(spool, result.waiting)
    if result.rejected or now - _last_prune.get(str(spool.root), 0.0) > 300:
        _last_prune[str(spool.root)] = now
        try:
            result.pruned = prune_rejected(spool, keep=keep_rejected, max_age_s=rejected_max_age_s,
                                           now=now, log=log)
        except OSError as exc:
            if log:
                log.warning("spool_prune_failed", error=str(exc))
    return result


def prepare_spool(spool: SpoolPaths, gate: SubmitGate, *, log=None) -> None:
    """The shared box's modes (once per spool and group; cheap to repeat after a change): the spool
    traversable, `incoming/` 1730 root:<submit group>, `rejected/` 0711, `claimed/` 0700."""
    gid = gate.gid
    key = (str(spool.root), gid)
    if key in _prepared:
        return
    spool.claimed("x").parent.mkdir(parents=True, exist_ok=True)
    for path, mode, group in ((spool.root, 0o755, 0), (spool.incoming, INCOMING_MODE, gid if gid is not None else 0),
                              (spool.rejected, REJECTED_MODE, 0), (spool.claimed("x").parent, PRIVATE_MODE, 0)):
        st = os.lstat(path)
        if (st.st_uid, st.st_gid) != (0, group):
            os.chown(path, 0, group, follow_symlinks=False)
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(path, mode)
    if gid is None and log:
        log.warning("submit_group_missing", group=gate.group,
                    note="only root can submit until the group exists (systemd-sysusers makes it)")
    _prepared.add(key)


def _list(folder: Path, *, limit: int) -> list[str]:
    try:
        with os.scandir(folder) as it:
            return heapq.nsmallest(limit, (e.name for e in it))
    except FileNotFoundError:
        return []


def _candidates(incoming: Path, *, limit: int) -> list[tuple[str, os.stat_result]]:
    """The `limit` oldest non-temporary entries, read in one pass with bounded memory."""
    def entries():
        with os.scandir(incoming) as it:
            for e in it:
                if _is_temp_name(e.name):
                    continue
                try:
                    yield e.name, e.stat(follow_symlinks=False)
                except OSError:
                    continue
    try:
        return heapq.nsmallest(limit, entries(), key=lambda x: (x[1].st_mtime_ns, x[0]))
    except FileNotFoundError:
        return []


def _settled(spool: SpoolPaths, name: str, st: os.stat_result, now: float, settle_s: float, log) -> bool:
    """Old enough, or - for an mtime in the future, which no age can pass - unchanged
    in size and mtime since the previous call."""
    if st.st_mtime <= now + 1.0:
        return now - st.st_mtime >= settle_s
    memo_key = (str(spool.incoming), name)
    seen = (st.st_ino, st.st_size, st.st_mtime_ns)
    if _future_seen.get(memo_key) == seen:
        _future_seen.pop(memo_key, None)
        if log:
            log.warning("spool_future_mtime", file=display_name(name), ahead_s=round(st.st_mtime - now, 1),
                        note="mtime is in the future; taken as settled after two unchanged passes")
        return True
    if memo_key not in _future_seen and log:
        log.info("spool_future_mtime_waiting", file=display_name(name), ahead_s=round(st.st_mtime - now, 1))
    _future_seen[memo_key] = seen
    return False


def _forget_future(spool: SpoolPaths, waiting: list[str]) -> None:
    keep = {(str(spool.incoming), n) for n in waiting}
    for k in [k for k in _future_seen if k[0] == str(spool.incoming) and k not in keep]:
        del _future_seen[k]


def _read_bounded(path: Path, max_bytes: int, gate: SubmitGate | None = None) -> tuple[os.stat_result, bytes]:
    """Read a regular file without following a link or blocking on a FIFO swapped in. With `gate`,
    the file as opened must belong to someone who may submit and (a shared box) have no other hard
    link (a link to another user's file would make that user its submitter)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise JobFileError([Problem("(file)", "is not a regular file")])
        if gate is not None:
            refused = gate.refusal(st.st_uid)
            if refused:
                raise JobFileError([Problem("(file)", f"was not submitted by someone who may: {refused}")])
            if gate.shared and st.st_nlink != 1:
                raise JobFileError([Problem("(file)", f"has {st.st_nlink} hard links; a job file must be a "
                                            "file of its own (copy it, or use `oom-supervisor submit`)")])
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 16, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:
            raise JobFileError([Problem("(file)", f"is over {max_bytes} bytes; job files are limited "
                                        f"to {max_bytes} bytes")])
        return st, b"".join(chunks)
    finally:
        os.close(fd)


def _process(spool: SpoolPaths, state: StatePaths, store: Store, path: Path, cname: str, name: str,
             max_bytes: int, policy_dirs: Sequence[Path] | None, result: IntakeResult, log,
             context: CheckContext, gate: SubmitGate | None = None) -> bool:
    """Accept or reject one claimed file. False when the state folder refused the job
    (disk full, database locked): the file stays claimed for the next call."""
    shown = display_name(name)
    try:  # for the reason's owner only; who submitted is read from the opened file (_read_bounded)
        owner = path.lstat().st_uid
    except OSError:
        owner = None
    try:
        spec, text, key, owner = _check(path, cname, shown, max_bytes, policy_dirs, store, spool.root, state,
                                        context, gate)
    except JobFileError as err:
        _reject(spool, path, name, err.problems, result, log, owner=owner)
        return True
    except Exception as exc:  # noqa: BLE001 - anything at all: that file is refused, intake goes on
        _reject(spool, path, name, [Problem("(file)", f"could not be read: {type(exc).__name__}: "
                                    f"{str(exc)[:200]}")], result, log, owner=owner)
        return True
    if spec is None:  # accepted before a crash; only the leftover remains
        _unlink(path)
        return True
    try:
        job_id = accept(state, store, spec, text=text, source=shown, key=key, owner_uid=owner)
    except (OSError, sqlite3.OperationalError) as exc:
        if log:
            log.error("spool_accept_failed", file=shown, state_dir=str(state.root), error=str(exc),
                      note="the file stays claimed and is taken at a later call")
        return False
    except Exception as exc:  # noqa: BLE001 - anything at all: that file is refused with the reason, intake goes on
        _reject(spool, path, name, [Problem("(file)", f"could not be recorded: {type(exc).__name__}: "
                                    f"{str(exc)[:200]}")], result, log, owner=owner)
        return True
    _unlink(path)
    result.accepted.append(job_id)
    if log:
        log.info("job_accepted", job=job_id, name=spec.name, file=shown, kind=spec.kind, owner=user_name(owner))
    return True


def _check(path: Path, cname: str, shown: str, max_bytes: int, policy_dirs: Sequence[Path] | None,
           store: Store, spool_root: Path, state: StatePaths, context: CheckContext,
           gate: SubmitGate | None = None) -> tuple[JobSpec | None, str, str, int]:
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        raise JobFileError([Problem("(file)", "is a symbolic link; symlinks are refused "
                                    "(copy the file into the spool instead)")])
    if not stat.S_ISREG(st.st_mode):
        raise JobFileError([Problem("(file)", f"is not a regular file ({_kind(st.st_mode)})")])
    if st.st_size > max_bytes:
        raise JobFileError([Problem("(file)", f"is {st.st_size} bytes; job files are limited to "
                                    f"{max_bytes} bytes")])
    st, data = _read_bounded(path, max_bytes, gate)
    key = spool_key(cname, st, data)
    if store.job_by_spool_key(key) is not None:
        return None, "", key, st.st_uid
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JobFileError([Problem("(file)", f"is not UTF-8 text (byte {exc.start})")]) from None
    if "\0" in text:
        raise JobFileError([Problem("(file)", "contains a NUL byte; job files are YAML text")])
    jobs = jobs_of(store.conn, state)
    with acting_as(_submitter(st.st_uid) if gate is not None and gate.shared else None):
        # A shared box: the job's paths (datasets, models) are looked at as its submitter sees them.
        checked = check_job(text, source=shown, submit_dir=spool_root, policy_dirs=policy_dirs,
                            context=context, jobs=jobs)
    return checked.spec, text, key, st.st_uid


def _submitter(uid: int):
    try:
        return lookup(uid)
    except UnknownUser:
        return None


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "an unknown kind"


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    fsync_dir(path.parent)


def accept(state: StatePaths, store: Store, spec: JobSpec, *, text: str, source: str,
           key: str | None, owner_uid: int | None = None) -> int:
    """Record the job with its submitter and write its job.yaml (0600: `env` may hold tokens) in
    one transaction."""
    with store.tx():
        job_id = store.add_job(name=spec.name, kind=spec.kind, priority=spec.sup.priority,
                               policy=spec.sup.policy, workdir=str(spec.workdir), source=source,
                               spool_key=key, owner_uid=owner_uid, owner=user_name(owner_uid))
        jp = state.job(job_id)
        if jp.root.exists():  # left by a crash before a commit that never happened
            jp.root.rename(jp.root.with_name(f".orphan-{job_id}-{time.time_ns()}"))
        jp.root.mkdir(parents=True)
        atomic_write_text(jp.job_file, text, mode=0o600)
    return job_id


def _reject(spool: SpoolPaths, path: Path, name: str, problems: list[Problem], result: IntakeResult,
            log=None, *, owner: int | None = None) -> None:
    """Move the file to rejected/ under a safe name, then say why beside it (original
    name escaped inside). The move comes first: it needs no space, so even on a full
    spool disk a bad file stops being retried."""
    shown = display_name(name)
    report = JobFileError(problems, shown).report() + "\n"
    if shown != safe_name(name):
        report += f"(the file was named {shown!r}; kept here as its safe name)\n"
    try:
        spool.rejected.mkdir(parents=True, exist_ok=True)
        dest = spool.rejected / safe_name(name)
        if os.path.lexists(dest) or os.path.lexists(f"{dest}.error.txt"):
            dest = dest.with_name(f"{dest.name}.{time.strftime('%Y%m%dT%H%M%S')}.{secrets.token_hex(3)}")
        os.rename(path, dest)
    except OSError as exc:
        if log:
            log.error("spool_reject_failed", file=shown, folder=str(spool.rejected), error=str(exc))
        return
    try:
        # Not fsynced: a report lost to a power cut costs nothing (the file is in rejected/).
        reason = dest.with_name(dest.name + ".error.txt")
        atomic_write_text(reason, report, mode=SPOOL_FILE_MODE, durable=False)
        if owner is not None and os.geteuid() == 0 and owner != 0:
            os.chown(reason, owner, -1, follow_symlinks=False)  # the submitter's alone (0600)
    except OSError as exc:
        if log:
            log.error("spool_reason_not_written", file=shown, folder=str(spool.rejected), error=str(exc))
    result.rejected.append((shown, report.strip()))
    if log:
        log.warning("job_rejected", file=shown, problems=[str(p)[:300] for p in problems[:5]])


def prune_rejected(spool: SpoolPaths, *, keep: int = KEEP_REJECTED, max_age_s: float = REJECTED_MAX_AGE_S,
                   now: float | None = None, log=None) -> int:
    """Keep at most `keep` rejected files, none older than `max_age_s` (by when they were
    rejected: the .error.txt's mtime); remove the oldest with their reasons. Returns how many."""
    now = time.time() if now is None else now
    entries: dict[str, float] = {}
    with os.scandir(spool.rejected) as it:
        for e in it:
            base = e.name.removesuffix(".error.txt")
            try:
                t = e.stat(follow_symlinks=False).st_mtime
            except OSError:
                continue
            if e.name.endswith(".error.txt") or base not in entries:
                entries[base] = t
    ordered = sorted(entries.items(), key=lambda kv: kv[1], reverse=True)
    doomed = [b for i, (b, t) in enumerate(ordered) if i >= keep or now - t > max_age_s]
    for base in doomed:
        for p in (spool.rejected / base, spool.rejected / f"{base}.error.txt"):
            try:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.ENOENT,) and log:
                    log.warning("spool_prune_failed", file=display_name(p.name), error=str(exc))
    if doomed and log:
        log.info("spool_rejected_pruned", removed=len(doomed), kept=len(ordered) - len(doomed),
                 keep=keep, max_age_days=round(max_age_s / 86400, 1))
    return len(doomed)


# --- submit ------------------------------------------------------------------------

def with_workdir(text: str, workdir: Path) -> str:
    """Record where `submit` ran, keeping the user's text (and comments) where possible."""
    return with_supervisor_key(text, "workdir", str(workdir), keep_existing=True)


def with_after(text: str, job_ids: Sequence[int]) -> str:
    """`submit --after JOB`: the job starts only once those jobs have succeeded."""
    data, _ = load_yaml_with_lines(text)
    sup = data.get("supervisor") if isinstance(data, dict) else None
    have = list(sup.get("after") or []) if isinstance(sup, dict) and isinstance(sup.get("after"), list) else []
    merged = have + [j for j in job_ids if j not in have]
    return with_supervisor_key(text, "after", merged, keep_existing=False)


def with_supervisor_key(text: str, key: str, value, *, keep_existing: bool) -> str:
    """Set `supervisor.<key>`, inserting one line where the block's layout allows (comments kept)."""
    data, lines = load_yaml_with_lines(text)
    sup = data.get("supervisor")
    if sup is not None and isinstance(sup, dict) and key in sup and keep_existing:
        return text
    quoted = yaml.safe_dump(value, default_flow_style=True, default_style='"' if isinstance(value, str) else None
                            ).strip().splitlines()[0].removesuffix("...").strip()
    if sup is None:
        sep = "" if text.endswith("\n") or not text else "\n"
        return f"{text}{sep}supervisor:\n  {key}: {quoted}\n"
    src = text.splitlines(keepends=True)
    line_no = lines.get("supervisor")
    child_lines = [v for k, v in lines.items() if k.startswith("supervisor.") and k.count(".") == 1]
    if (isinstance(sup, dict) and key not in sup and line_no and src[line_no - 1].rstrip().endswith("supervisor:")
            and child_lines):
        first = src[min(child_lines) - 1]
        indent = first[: len(first) - len(first.lstrip())]
        src.insert(line_no, f"{indent}{key}: {quoted}\n")
        return "".join(src)
    data = dict(data)
    data["supervisor"] = {**(sup or {}), key: value}
    return yaml.safe_dump(data, sort_keys=False)


def submit(spool: SpoolPaths, text: str, *, name: str, cwd: Path,
           policy_dirs: Sequence[Path] | None = None, context: CheckContext | None = None,
           state: StatePaths | None = None, checked_out: list | None = None) -> Path:
    """Validate (the same checks as intake: `check_job`), then place the job in incoming/
    atomically, mode 0600: the caller owns it, which makes them its submitter, and nobody else can
    read it. Raises
    JobFileError; OSError when the spool cannot be written. The Checked (warnings, notes)
    is appended to `checked_out` when given."""
    shown = display_name(Path(name).name)
    context = context or CheckContext()
    jobs = read_jobs(state) if state is not None else None
    checked = check_job(text, source=shown, submit_dir=cwd, policy_dirs=policy_dirs, context=context, jobs=jobs)
    final_text = with_workdir(text, cwd)
    parse_job_text(final_text, source=shown, submit_dir=cwd, check_lf=False)
    if checked_out is not None:
        checked_out.append(checked)
    spool.ensure()
    stem = _SAFE.sub("_", shown).lstrip(".")
    for suffix in (".yaml", ".yml"):
        stem = stem.removesuffix(suffix)
    stem = stem[:80] or "job"
    dest = spool.incoming / f"{stem}.{time.strftime('%Y%m%dT%H%M%S')}.{secrets.token_hex(3)}.yaml"
    # The temp name is dot-prefixed, so intake never reads it half-written.
    atomic_write_text(dest, final_text, mode=SPOOL_FILE_MODE)
    return dest


# --- the checks submit and intake share -------------------------------------------------------

@dataclass
class CheckContext:
    """What the attempts of a job will see, as far as the checking process can tell.

    `base_env`: the environment attempts inherit (the daemon's own at intake; at submit, the
    submitter's, a best guess that is said). `daemon_env`: the daemon config's `env:`.
    `launch_here`: False when attempts run on other machines (Slurm), where a path missing
    here may exist."""

    base_env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    daemon_env: dict[str, str] = field(default_factory=dict)
    launch_here: bool = True
    where: str = "submit"


@dataclass
class Checked:
    spec: JobSpec
    warnings: list[Problem]
    notes: list[str]


def check_job(text: str, *, source: str, submit_dir: Path, policy_dirs: Sequence[Path] | None,
              context: CheckContext, jobs: dict[int, preflight.JobFact] | None) -> Checked:
    """Parse and check a job file: every problem in one report (JobFileError), in file order.
    The pre-launch checks (`preflight`) run even when parsing found problems, on what it could read."""
    policy_problem = None
    if policy_dirs is not None:
        from supervisor.judge.policy.schema import unknown_policy_problem

        def policy_problem(name: str) -> Problem | None:
            return unknown_policy_problem(name, search_dirs=policy_dirs)

    warnings: list[Problem] = []
    try:
        spec = parse_job_text(text, source=source, submit_dir=submit_dir, policy_problem=policy_problem,
                              warnings=warnings)
        part = Partial(spec.config if spec.kind == "llamafactory" else None, spec.workdir, spec.lines,
                       dict(spec.sup.env), tuple(spec.sup.after), spec.kind)
        problems: list[Problem] = []
    except JobFileError as err:
        if err.partial is None:
            raise
        spec, part, problems = None, err.partial, list(err.problems)
    env = facts_mod.job_env(context.base_env, context.daemon_env, part.env)
    facts = facts_mod.gather(part.config, workdir=str(part.workdir), env=env, after=part.after,
                             launch_here=context.launch_here, jobs=jobs, where=context.where)
    res = preflight.check(part.config, workdir=str(part.workdir), facts=facts, after=part.after, lines=part.lines)
    problems += res.problems
    warnings += res.warnings
    if problems:
        raise JobFileError(problems, source, warnings=warnings)
    assert spec is not None
    return Checked(spec, warnings, res.notes)


def read_jobs(state: StatePaths) -> dict[int, preflight.JobFact] | None:
    """The recorded jobs, read-only, for `submit` (None when the record cannot be read: a service's
    state folder is the daemon's alone; the daemon's intake checks again)."""
    try:
        if not state.db.exists():
            return {} if state.root.is_dir() or not state.root.exists() else None
        conn = sqlite3.connect(f"file:{state.db}?mode=ro", uri=True, timeout=5.0)
    except (OSError, sqlite3.Error):
        return None
    try:
        return jobs_of(conn, state)
    except (OSError, sqlite3.Error):
        return None
    finally:
        conn.close()


def jobs_of(conn: sqlite3.Connection, state: StatePaths) -> dict[int, preflight.JobFact]:
    """Every job's id and state; the output_dir of those not ended (from their job.yaml)."""
    out: dict[int, preflight.JobFact] = {}
    for row in conn.execute("SELECT id, state, name, workdir FROM jobs"):
        job_id, st, name, workdir = row[0], str(row[1]), row[2] or "", row[3] or "/"
        out_dir = None
        if st not in preflight.TERMINAL:
            out_dir = output_dir_of_job(state, job_id, workdir)
        out[job_id] = preflight.JobFact(job_id, st, out_dir, name)
    return out


def output_dir_of_job(state: StatePaths, job_id: int, workdir: str) -> str | None:
    """A recorded job's output_dir, absolute (None: not a LLaMA-Factory job, or unreadable here)."""
    try:
        data, _ = load_yaml_with_lines(state.job(job_id).job_file.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    if not isinstance(data, dict) or "command" in (data.get("supervisor") or {}):
        return None
    out = facts_mod.output_dir_of(data, workdir)  # the record's workdir is the job's, resolved
    return facts_mod.realpath_prefix(out) if out else None
