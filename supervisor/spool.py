"""The spool folder: how jobs get in.

`incoming/` receives job files (by `submit`, or a plain `cp`/`mv`). The daemon
accepts a file by recording the job and copying it to `jobs/<id>/job.yaml`
in one SQLite transaction, then removing it from incoming. Each file carries a
key (name, inode, mtime, size, content hash): if the daemon dies after the
commit but before the unlink, the next intake sees the key already recorded
and only removes the leftover, so a crash can neither lose nor duplicate a job.
Bad files go to `rejected/` with `<name>.error.txt` saying what is wrong.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .fsutil import atomic_write_text, fsync_dir
from .jobspec import JobFileError, JobSpec, load_yaml_with_lines, parse_job_text
from .models import Problem
from .paths import SpoolPaths, StatePaths
from .store import Store

TEMP_SUFFIXES = (".tmp", ".part", ".partial", ".swp", "~")


@dataclass
class IntakeResult:
    accepted: list[int] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)  # too young to read yet


def _is_temp_name(name: str) -> bool:
    return name.startswith(".") or name.endswith(TEMP_SUFFIXES) or name.endswith(".error.txt")


def spool_key(name: str, st: os.stat_result, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()[:16]
    return f"{name}:{st.st_ino}:{st.st_mtime_ns}:{st.st_size}:{digest}"


def intake(spool: SpoolPaths, state: StatePaths, store: Store, *, settle_s: float,
           max_bytes: int, now: float | None = None, log=None) -> IntakeResult:
    """Accept or reject every settled file in incoming/ (oldest first)."""
    spool.ensure()
    state.ensure()
    now = time.time() if now is None else now
    result = IntakeResult()
    try:
        entries = sorted(os.scandir(spool.incoming), key=lambda e: _mtime(e))
    except FileNotFoundError:
        return result
    for entry in entries:
        name = entry.name
        if _is_temp_name(name):
            continue
        path = Path(entry.path)
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            _reject(spool, path, name, [Problem("(file)", "is a symbolic link; symlinks are refused "
                                                "(copy the file into the spool instead)")], result)
            continue
        if not stat.S_ISREG(st.st_mode):
            _reject(spool, path, name, [Problem("(file)", "is not a regular file")], result)
            continue
        if now - st.st_mtime < settle_s:
            result.waiting.append(name)
            continue
        if st.st_size > max_bytes:
            _reject(spool, path, name, [Problem("(file)", f"is {st.st_size} bytes; job files are "
                                                f"limited to {max_bytes} bytes")], result)
            continue
        try:
            data = path.read_bytes()
        except OSError as exc:
            if log:
                log.warning("spool_unreadable", file=name, error=str(exc))
            continue
        key = spool_key(name, st, data)
        if store.job_by_spool_key(key) is not None:
            path.unlink(missing_ok=True)  # accepted before a crash; only the leftover remains
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            _reject(spool, path, name, [Problem("(file)", f"is not UTF-8 text (byte {exc.start})")], result)
            continue
        try:
            spec = parse_job_text(text, source=name, submit_dir=spool.root)
        except JobFileError as err:
            _reject(spool, path, name, err.problems, result)
            continue
        job_id = accept(state, store, spec, text=text, source=name, key=key)
        path.unlink(missing_ok=True)
        fsync_dir(spool.incoming)
        result.accepted.append(job_id)
        if log:
            log.info("job_accepted", job=job_id, name=spec.name, file=name, kind=spec.kind)
    return result


def accept(state: StatePaths, store: Store, spec: JobSpec, *, text: str, source: str,
           key: str | None) -> int:
    """Record the job and write its job.yaml in one transaction."""
    with store.tx():
        job_id = store.add_job(name=spec.name, kind=spec.kind, priority=spec.sup.priority,
                               policy=spec.sup.policy, workdir=str(spec.workdir), source=source,
                               spool_key=key)
        jp = state.job(job_id)
        if jp.root.exists():  # left by a crash before a commit that never happened
            jp.root.rename(jp.root.with_name(f".orphan-{job_id}-{time.time_ns()}"))
        jp.root.mkdir(parents=True)
        atomic_write_text(jp.job_file, text)
    return job_id


def _mtime(entry: os.DirEntry) -> float:
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return 0.0


def _reject(spool: SpoolPaths, path: Path, name: str, problems: list[Problem], result: IntakeResult) -> None:
    spool.rejected.mkdir(parents=True, exist_ok=True)
    dest = spool.rejected / name
    if dest.exists() or dest.is_symlink():
        dest = spool.rejected / f"{name}.{time.strftime('%Y%m%dT%H%M%S')}.{secrets.token_hex(2)}"
    report = JobFileError(problems, name).report() + "\n"
    atomic_write_text(dest.with_name(dest.name + ".error.txt"), report)
    try:
        os.rename(path, dest)
    except OSError:
        pass
    result.rejected.append((name, report.strip()))


# --- submit ------------------------------------------------------------------------

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def with_workdir(text: str, workdir: Path) -> str:
    """Record where `submit` ran, keeping the user's text (and comments) where possible."""
    data, lines = load_yaml_with_lines(text)
    sup = data.get("supervisor")
    if sup is not None and isinstance(sup, dict) and "workdir" in sup:
        return text
    quoted = yaml.safe_dump(str(workdir), default_style='"').strip().splitlines()[0]
    if sup is None:
        sep = "" if text.endswith("\n") or not text else "\n"
        return f"{text}{sep}supervisor:\n  workdir: {quoted}\n"
    src = text.splitlines(keepends=True)
    line_no = lines.get("supervisor")
    child_lines = [v for k, v in lines.items() if k.startswith("supervisor.") and k.count(".") == 1]
    if isinstance(sup, dict) and line_no and src[line_no - 1].rstrip().endswith("supervisor:") and child_lines:
        first = src[min(child_lines) - 1]
        indent = first[: len(first) - len(first.lstrip())]
        src.insert(line_no, f"{indent}workdir: {quoted}\n")
        return "".join(src)
    data = dict(data)
    data["supervisor"] = {**(sup or {}), "workdir": str(workdir)}
    return yaml.safe_dump(data, sort_keys=False)


def submit(spool: SpoolPaths, text: str, *, name: str, cwd: Path) -> Path:
    """Validate, then place the job in incoming/ atomically. Raises JobFileError."""
    parse_job_text(text, source=name, submit_dir=cwd)
    final_text = with_workdir(text, cwd)
    parse_job_text(final_text, source=name, submit_dir=cwd)
    spool.ensure()
    stem = _SAFE.sub("_", Path(name).name)
    for suffix in (".yaml", ".yml"):
        stem = stem.removesuffix(suffix)
    dest = spool.incoming / f"{stem}.{time.strftime('%Y%m%dT%H%M%S')}.{secrets.token_hex(3)}.yaml"
    atomic_write_text(dest, final_text)  # temp name is dot-prefixed, so intake never reads it half-written
    return dest
