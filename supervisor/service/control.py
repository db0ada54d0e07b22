"""The query and control socket: how users of a shared box see and steer their jobs.

On a shared box the state folder is root's alone, so a user's `status`, `show`, `logs`, `watch`,
`cancel` and `retry` go through this Unix socket, served by the daemon from a thread of its own.
The kernel says who is asking (SO_PEERCRED, as docker and pueue do); nothing the client sends
about itself is believed. `status` lists every job (id, owner, name, state: like squeue); the rest
only works on the caller's own jobs, unless the caller is root or in the admin group. Cancel and
retry write the same durable flags as the CLI does (record/requests.py); the loop acts on them.

Protocol: one JSON object per connection, one line each way: {"op": ..., ...} ->
{"ok": true, "result": ...} or {"ok": false, "error": "...", "code": 2}. Bounded: a request is
at most 64 KiB and must arrive within 5 s, at most 16 connections are served at once (more are
told "busy"), each user gets 20 requests a second with bursts of 60, and a log is read at most
1 MiB per request. A malformed request gets an error; nothing a client sends stops the server.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.core.paths import StatePaths
from supervisor.record import requests
from supervisor.record.store import JobRow, Store
from supervisor.run.identity import member_of, user_name

MAX_REQUEST = 64 << 10
MAX_LOG_CHUNK = 1 << 20
READ_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 16
RATE_PER_S, BURST = 20.0, 60.0
PUBLIC_FIELDS = ("id", "owner", "name", "state", "attempts", "submitted_at", "updated_at")
OPS = ("status", "show", "logs", "cancel", "retry", "unpause", "find")


class Refused(Exception):
    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Caller:
    pid: int
    uid: int
    gid: int
    user: str
    admin: bool

    def owns(self, job: JobRow) -> bool:
        return self.admin or (job.owner_uid is not None and job.owner_uid == self.uid)


def peer(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, from the kernel."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


class _Buckets:
    """A token bucket per uid: `rate` requests a second, `burst` at once."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens: dict[int, tuple[float, float]] = {}
        self.lock = threading.Lock()

    def take(self, uid: int) -> bool:
        now = time.monotonic()
        with self.lock:
            have, at = self.tokens.get(uid, (self.burst, now))
            have = min(self.burst, have + (now - at) * self.rate)
            ok = have >= 1.0
            self.tokens[uid] = (have - 1.0 if ok else have, now)
            return ok


class ControlServer:
    def __init__(self, path: Path, state: StatePaths, *, submit_group: str | None, admin_group: str | None,
                 daemon_uid: int | None = None, log=None, rate: float = RATE_PER_S, burst: float = BURST,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.path, self.state, self.log = path, state, log
        self.submit_group, self.admin_group = submit_group, admin_group
        self.daemon_uid = os.geteuid() if daemon_uid is None else daemon_uid
        self.buckets = _Buckets(rate, burst)
        self.slots = threading.BoundedSemaphore(max_connections)
        self.sock: socket.socket | None = None
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()
        self.served = self.refused = 0

    # --- lifecycle ----------------------------------------------------------------------
    def start(self) -> bool:
        """Listen on the socket (a stale one from a crash is replaced); False, said, if it cannot."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                st = self.path.lstat()
                if not stat.S_ISSOCK(st.st_mode):
                    raise OSError(f"{self.path} exists and is not a socket; not replacing it")
                self.path.unlink()  # ours from before: the state lock keeps a second daemon out
            except FileNotFoundError:
                pass
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(str(self.path))
            # Anyone may connect; the kernel's word on who they are decides what they get.
            os.chmod(self.path, 0o666)
            s.listen(64)
            s.settimeout(0.5)
        except OSError as exc:
            if self.log is not None:
                self.log.error("control_socket_failed", path=str(self.path), error=str(exc),
                               note="users cannot reach their jobs until it is fixed; root's CLI still works")
            return False
        self.sock = s
        self.thread = threading.Thread(target=self._accept, name="control-socket", daemon=True)
        self.thread.start()
        if self.log is not None:
            self.log.info("control_socket", path=str(self.path), submit_group=self.submit_group,
                          admin_group=self.admin_group)
        return True

    def stop(self, timeout: float = 2.0) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout)
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            try:
                self.path.unlink()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self.stopping.is_set():
                    return
                time.sleep(0.05)
                continue
            if not self.slots.acquire(blocking=False):
                self._send(conn, {"ok": False, "error": "the supervisor is busy; try again", "code": 1})
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="control-request", daemon=True).start()

    # --- one request --------------------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(READ_TIMEOUT_S)
                try:
                    reply = {"ok": True, "result": self.handle(conn)}
                    self.served += 1
                except Refused as exc:
                    self.refused += 1
                    reply = {"ok": False, "error": str(exc), "code": exc.code}
                except Exception as exc:  # a bug of ours: the client hears of it, the server goes on
                    if self.log is not None:
                        self.log.exception("control_request_failed")
                    reply = {"ok": False, "error": f"internal error: {type(exc).__name__}", "code": 1}
                self._send(conn, reply)
        finally:
            self.slots.release()

    def _send(self, conn: socket.socket, reply: dict) -> None:
        try:
            conn.sendall(json.dumps(reply, default=str).encode() + b"\n")
        except OSError:
            pass

    def handle(self, conn: socket.socket) -> Any:
        pid, uid, gid = peer(conn)
        req = _read_request(conn)  # first, bounded: a reply to an unread request would reset it
        caller = self._caller(pid, uid, gid)
        if not self.buckets.take(uid):
            raise Refused("too many requests; slow down", code=1)
        op = req.get("op")
        if op not in OPS:
            raise Refused(f"unknown request {str(op)[:40]!r}; known: {', '.join(OPS)}")
        store = Store(self.state.db)
        try:
            return getattr(self, f"op_{op}")(store, caller, req)
        finally:
            store.close()

    def _caller(self, pid: int, uid: int, gid: int) -> Caller:
        admin = uid == 0 or uid == self.daemon_uid or member_of(uid, self.admin_group)
        if not admin and not (self.submit_group and member_of(uid, self.submit_group)):
            raise Refused(f"{user_name(uid)} may not use this supervisor: ask to be added to the group "
                          f"{self.submit_group!r}")
        return Caller(pid, uid, gid, user_name(uid) or str(uid), admin)

    def _own_job(self, store: Store, caller: Caller, req: dict) -> JobRow:
        job_id = req.get("job")
        if not isinstance(job_id, int) or isinstance(job_id, bool):
            raise Refused("the request needs a job id (an integer)")
        job = store.job(job_id)
        if job is None:
            raise Refused(f"no job {job_id}")
        if not caller.owns(job):
            raise Refused(f"job {job_id} is {job.owner or 'the daemon'}'s, not yours: only its owner or an "
                          f"admin (group {self.admin_group!r}) may see or change it")
        return job

    # --- the requests -------------------------------------------------------------------
    def op_status(self, store: Store, caller: Caller, req: dict) -> dict:
        from supervisor.cli.timeline import job_summary

        rows = []
        for job in store.jobs():
            row = job_summary(store, job)
            rows.append(row if caller.owns(job) else {k: row[k] for k in PUBLIC_FIELDS})
        return {"jobs": rows, "paused": store.get_meta("queue_paused"), "you": caller.user,
                "admin": caller.admin}

    def op_show(self, store: Store, caller: Caller, req: dict) -> dict:
        from supervisor.cli.timeline import job_timeline

        return job_timeline(store, self._own_job(store, caller, req).id)

    def op_logs(self, store: Store, caller: Caller, req: dict) -> dict:
        job = self._own_job(store, caller, req)
        last = store.last_attempt(job.id)
        number = req.get("attempt") or (last.number if last else None)
        if number is None:
            raise Refused(f"job {job.id} has no attempts yet")
        if not isinstance(number, int) or store.attempt(job.id, number) is None:
            raise Refused(f"job {job.id} has no attempt {number}")
        offset, limit, tail = req.get("offset", 0), req.get("max", MAX_LOG_CHUNK), req.get("tail")
        if not all(isinstance(v, int) and v >= 0 for v in (offset, limit)) or (
                tail is not None and (not isinstance(tail, int) or tail < 0)):
            raise Refused("offset, max and tail are byte counts (integers >= 0)")
        data, size, start = _read_log(self.state.job(job.id).attempt(number).log, offset,
                                      min(limit, MAX_LOG_CHUNK), tail)
        return {"attempt": number, "latest": last.number if last else None, "offset": start + len(data),
                "size": size, "data": base64.b64encode(data).decode(), "state": str(job.state),
                "terminal": job.state.terminal}

    def op_cancel(self, store: Store, caller: Caller, req: dict) -> dict:
        return _reply(requests.cancel(store, self._own_job(store, caller, req).id, who=caller.user))

    def op_retry(self, store: Store, caller: Caller, req: dict) -> dict:
        return _reply(requests.retry(store, self._own_job(store, caller, req).id, who=caller.user))

    def op_unpause(self, store: Store, caller: Caller, req: dict) -> dict:
        if not caller.admin:
            raise Refused(f"unpausing the queue is for admins (group {self.admin_group!r}) and root")
        return _reply(requests.unpause(store, who=caller.user))

    def op_find(self, store: Store, caller: Caller, req: dict) -> dict:
        """The job a spool file became (for `submit --wait`), if it is the caller's."""
        source = req.get("source")
        if not isinstance(source, str) or len(source) > 1024:
            raise Refused("the request needs the spool file's name")
        row = store.conn.execute("SELECT id FROM jobs WHERE source=? AND owner_uid=?", (source, caller.uid)).fetchone()
        return {"job": row[0] if row else None}


def _reply(r: requests.Reply) -> dict:
    return {"code": r.code, "message": r.message, "error": r.error}


def _read_request(conn: socket.socket) -> dict:
    buf = b""
    while b"\n" not in buf:
        try:
            chunk = conn.recv(min(65536, MAX_REQUEST + 1 - len(buf)))
        except TimeoutError:
            raise Refused(f"no complete request within {READ_TIMEOUT_S:.0f} s") from None
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_REQUEST:
            _drain(conn, 16 * MAX_REQUEST)  # so the refusal reaches it (unread data resets a Unix socket)
            raise Refused(f"request over {MAX_REQUEST} bytes")
    try:
        req = json.loads(buf.split(b"\n", 1)[0] or b"null")
    except (ValueError, UnicodeDecodeError):
        raise Refused("the request is not JSON") from None
    if not isinstance(req, dict):
        raise Refused('the request must be a JSON object: {"op": ...}')
    return req


def _drain(conn: socket.socket, limit: int) -> None:
    """Read and drop what the client still sends, up to `limit` bytes or the read timeout."""
    try:
        while limit > 0 and (chunk := conn.recv(min(65536, limit))):
            limit -= len(chunk)
    except OSError:
        pass


def _read_log(path: Path, offset: int, limit: int, tail: int | None) -> tuple[bytes, int, int]:
    """(bytes from `offset`, or the last `tail` bytes; the log's size; where they start). Opened
    without following a link: on a shared box the log belongs to the job's user."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return b"", 0, 0
    except OSError as exc:
        raise Refused(f"the log cannot be read: {exc.strerror}", code=1) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused("the log is not a regular file", code=1)
        start = max(0, st.st_size - tail) if tail is not None else offset
        return os.pread(fd, limit, start), st.st_size, start
    finally:
        os.close(fd)



def serve(cfg, *, log=None) -> ControlServer | None:
    """The daemon's server for its config: on a shared box (system mode) with a socket configured."""
    if not cfg.system_mode or cfg.control_socket is None:
        return None
    server = ControlServer(cfg.control_socket, cfg.state, submit_group=cfg.submit_group,
                           admin_group=cfg.admin_group, log=log)
    return server if server.start() else None
