"""systemd's notify protocol (sd_notify(3)) in a few lines: READY, STATUS, WATCHDOG, STOPPING.

Datagrams to `$NOTIFY_SOCKET` (a path, or `@name` for an abstract socket). Without systemd
the variable is unset and every call is a no-op. A failed send is logged once and never
raises: telling systemd must not break the loop it reports on. The variables are removed from
the environment on construction so trainings (children) do not inherit them.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import MutableMapping

ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def watchdog_interval(env: MutableMapping[str, str], pid: int | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC, as sd_watchdog_enabled advises),
    or None when the watchdog is off or meant for another process."""
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    wpid = env.get("WATCHDOG_PID", "")
    if wpid and (not wpid.isdigit() or int(wpid) != (pid if pid is not None else os.getpid())):
        return None
    return int(usec) / 1e6 / 2


def status_line(*, running: int, queued: int, waiting: int = 0, paused: str | None = None) -> str:
    """The one-line summary `systemctl status` shows."""
    parts = [f"{running} running", f"{queued} queued"]
    if waiting:
        parts.append(f"{waiting} waiting to retry")
    line = ", ".join(parts)
    if paused:
        line += f"; queue PAUSED: {paused}"
    return " ".join(line.split())[:200]  # one line, bounded


def status_from_store(store, *, running: int) -> str:
    """status_line from the record: queued counts interrupted jobs too (they resume next)."""
    n: dict[str, int] = {}
    for (state,) in store.conn.execute("SELECT state FROM jobs WHERE state IN "
                                       "('queued', 'interrupted', 'waiting_retry')"):
        n[state] = n.get(state, 0) + 1
    return status_line(running=running, queued=n.get("queued", 0) + n.get("interrupted", 0),
                       waiting=n.get("waiting_retry", 0), paused=store.get_meta("queue_paused"))


class ServiceNotifier:
    def __init__(self, address: str | None, *, watchdog_s: float | None = None, log=None,
                 clock=time.monotonic) -> None:
        self.address = address
        self.watchdog_s = watchdog_s
        self.log = log
        self.clock = clock
        self._last_ping = float("-inf")
        self._warned = False
        self._sock: socket.socket | None = None
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_env(cls, env: MutableMapping[str, str] | None = None, *, log=None,
                 unset: bool = True) -> ServiceNotifier:
        env = os.environ if env is None else env
        address, watchdog_s = env.get("NOTIFY_SOCKET") or None, watchdog_interval(env)
        if unset:
            for k in ENV_VARS:
                env.pop(k, None)
        return cls(address, watchdog_s=watchdog_s, log=log)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, **fields: object) -> bool:
        """One datagram of KEY=value lines; False when not sent (no systemd, or an error)."""
        if self._sock is None:
            return False
        msg = "\n".join(f"{k}={str(v).replace(chr(10), ' ')}" for k, v in fields.items())
        addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            self._sock.sendto(msg.encode(), addr)
            return True
        except OSError as exc:
            if not self._warned and self.log is not None:
                self.log.warning("sd_notify_failed", error=str(exc))
            self._warned = True
            return False

    def ready(self, status: str | None = None) -> bool:
        """Recovery done: `systemctl start` returns and dependants start."""
        return self.send(READY=1, **({"STATUS": status} if status else {}))

    def status(self, text: str) -> bool:
        return self.send(STATUS=text)

    def watchdog(self) -> bool:
        """Call every tick; pings at most every `watchdog_s` (half of WatchdogSec)."""
        if self.watchdog_s is None:
            return False
        now = self.clock()
        if now - self._last_ping < self.watchdog_s:
            return False
        self._last_ping = now
        return self.send(WATCHDOG=1)

    def stopping(self, status: str | None = None) -> bool:
        return self.send(STOPPING=1, **({"STATUS": status} if status else {}))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
