"""Who a job belongs to, from the user database.

On a shared box (system mode: the daemon runs as root) every job runs as the user who submitted
it, the way `at`, `batch` and Slurm do it: the submitter is the owner of the spool file `submit`
created (read from the opened file), and only members of the submit group may submit. What an
attempt runs as is looked up again when it starts (uid, primary gid, supplementary groups, home),
so a user removed from a group, or from the box, loses it for their next attempt too.
"""

from __future__ import annotations

import ctypes
import grp
import os
import platform
import pwd
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


class UnknownUser(LookupError):
    pass


@dataclass(frozen=True)
class Identity:
    """What a process of the job runs as (the shim sets it in the child before exec)."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    user: str
    home: str
    shell: str = "/bin/sh"

    def to_dict(self) -> dict:
        return {"uid": self.uid, "gid": self.gid, "groups": list(self.groups), "user": self.user,
                "home": self.home, "shell": self.shell}

    @classmethod
    def from_dict(cls, d: dict) -> Identity:
        return cls(uid=int(d["uid"]), gid=int(d["gid"]), groups=tuple(int(g) for g in d.get("groups") or ()),
                   user=str(d["user"]), home=str(d["home"]), shell=str(d.get("shell") or "/bin/sh"))

    def login_env(self) -> dict[str, str]:
        return {"HOME": self.home, "USER": self.user, "LOGNAME": self.user}


def lookup(uid: int) -> Identity:
    """The user database's entry for `uid`, with every group it is a member of."""
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        raise UnknownUser(f"uid {uid} is not in the user database (was the account removed?)") from None
    groups = tuple(sorted(set(os.getgrouplist(pw.pw_name, pw.pw_gid))))
    return Identity(uid=pw.pw_uid, gid=pw.pw_gid, groups=groups, user=pw.pw_name, home=pw.pw_dir,
                    shell=pw.pw_shell or "/bin/sh")


def myself() -> Identity:
    """The daemon's own user (single-user mode: its jobs run as it)."""
    try:
        return lookup(os.geteuid())
    except UnknownUser:  # a container's uid without an entry
        return Identity(uid=os.geteuid(), gid=os.getegid(), groups=tuple(os.getgroups()),
                        user=os.environ.get("USER") or str(os.geteuid()), home=os.environ.get("HOME") or "/")


def user_name(uid: int | None) -> str | None:
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def group_id(name: str | None) -> int | None:
    if not name:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def member_of(uid: int, group: str | None) -> bool:
    """True when the user `uid` is in `group` (primary or supplementary) per the user database."""
    gid = group_id(group)
    if gid is None:
        return False
    try:
        return gid in lookup(uid).groups
    except UnknownUser:
        return False


@dataclass(frozen=True)
class SubmitGate:
    """Whose files are jobs. A shared box (`group` given): root's, and those of the members of
    `group`, each run as its submitter. A single-user daemon (`group` None): only the daemon's own
    user's (and root's), as jobs run as the daemon's user: nobody can make it run their file as
    someone else."""

    group: str | None
    daemon_uid: int = 0

    @property
    def shared(self) -> bool:
        return self.group is not None

    @property
    def gid(self) -> int | None:
        return group_id(self.group)

    def refusal(self, uid: int) -> str | None:
        """Why a file owned by `uid` is not a job this daemon may run (None: it is)."""
        if uid == 0 or (not self.shared and uid == self.daemon_uid):
            return None
        try:
            who = lookup(uid)
        except UnknownUser as exc:
            return f"its owner, {exc}"
        if not self.shared:
            return (f"its owner {who.user} (uid {uid}) is not this daemon's user ({user_name(self.daemon_uid)}); "
                    "a single-user daemon runs its own user's jobs only (a shared box runs the system unit)")
        if self.gid is None:
            return (f"its owner {who.user} (uid {uid}) cannot submit: the submit group {self.group!r} does not "
                    "exist on this box (only root can submit until it does)")
        if self.gid not in who.groups:
            return (f"its owner {who.user} (uid {uid}) is not a member of {self.group!r}; only its members may "
                    f"submit (sudo usermod -aG {self.group} {who.user})")
        return None


# Raw system call numbers: glibc's setgroups (and setuid family) change every thread of the process
# (POSIX semantics, its setxid broadcast); the kernel's calls change the calling thread only.
_SYSCALLS = {"x86_64": {"setgroups": 116, "setfsuid": 122, "setfsgid": 123},
             "aarch64": {"setgroups": 159, "setfsuid": 151, "setfsgid": 152}}


class ActingError(OSError):
    pass


def _syscall(name: str, *args) -> int:
    nums = _SYSCALLS.get(platform.machine())
    if nums is None:
        raise ActingError(f"acting as a user on this thread is not supported on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(nums[name], *args)


def _thread_groups(groups: tuple[int, ...] | list[int]) -> None:
    arr = (ctypes.c_uint * max(1, len(groups)))(*groups)
    if _syscall("setgroups", ctypes.c_size_t(len(groups)), arr) != 0:
        raise ActingError(ctypes.get_errno(), "setgroups on this thread failed")


def _fsids(uid: int, gid: int) -> None:
    _syscall("setfsgid", ctypes.c_uint(gid))
    _syscall("setfsuid", ctypes.c_uint(uid))
    # setfs*id(-1) changes nothing and returns the current value: the only way to know it took.
    if _syscall("setfsuid", ctypes.c_uint(0xFFFFFFFF)) != uid or _syscall("setfsgid", ctypes.c_uint(0xFFFFFFFF)) != gid:
        raise ActingError(f"could not act as uid {uid} gid {gid} on this thread")


@contextmanager
def acting_as(identity: Identity | None) -> Iterator[None]:
    """File access on this thread as `identity` (its fs uid, fs gid and groups), the rest of the
    process untouched: the daemon (root) reads and changes a job's output folder with exactly the
    job's user's rights, so a path or a link the user chose cannot reach what they may not (another
    user's checkpoints, the state folder). No-op for None or when not root. A program started
    inside must still be given the user itself (subprocess user=...): exec takes the real uid; a
    thread started inside would keep the user's rights: start none."""
    if identity is None or os.geteuid() != 0 or identity.uid == 0:
        yield
        return
    groups = os.getgroups()
    _thread_groups(identity.groups)
    try:
        _fsids(identity.uid, identity.gid)
        yield
    finally:
        _fsids(0, os.getegid())
        _thread_groups(groups)


def as_user_kwargs(identity: Identity | None) -> dict:
    """subprocess arguments that run a program as `identity` (nothing for None or when not root)."""
    if identity is None or os.geteuid() != 0 or identity.uid == 0:
        return {}
    return {"user": identity.uid, "group": identity.gid, "extra_groups": list(identity.groups)}
