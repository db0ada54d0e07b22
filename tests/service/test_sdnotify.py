"""sd_notify over a real AF_UNIX datagram socket, as systemd's manager listens on it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from supervisor.service.sdnotify import (
    ServiceNotifier,
    status_from_store,
    status_line,
    watchdog_interval,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def listener():
    d = tempfile.mkdtemp(prefix="sdn")  # AF_UNIX paths are limited to 108 bytes: keep it short
    path = os.path.join(d, "notify")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(5)
    yield s, path
    s.close()
    os.unlink(path)
    os.rmdir(d)


def recv(s: socket.socket) -> dict[str, str]:
    return dict(line.split("=", 1) for line in s.recv(4096).decode().splitlines())


def test_ready_status_watchdog_stopping_from_a_real_process(listener):
    s, path = listener
    code = ("from supervisor.service.sdnotify import ServiceNotifier as N, status_line as L\n"
            "import os\n"
            "n = N.from_env()\n"
            "assert 'NOTIFY_SOCKET' not in os.environ, 'children must not inherit it'\n"
            "n.ready(L(running=1, queued=2))\n"
            "n.status(L(running=0, queued=3, paused='disk full on /data'))\n"
            "n.watchdog(); n.watchdog()\n"   # the second is within the interval: not sent
            "n.stopping()\n")
    env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "120000000"}
    subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, check=True, timeout=30)
    assert recv(s) == {"READY": "1", "STATUS": "1 running, 2 queued"}
    assert recv(s) == {"STATUS": "0 running, 3 queued; queue PAUSED: disk full on /data"}
    assert recv(s) == {"WATCHDOG": "1"}
    assert recv(s) == {"STOPPING": "1"}


def test_abstract_socket():
    name = f"oom-supervisor-test-{os.getpid()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(5)
    try:
        n = ServiceNotifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert n.ready("line one\nline two")
        assert recv(s) == {"READY": "1", "STATUS": "line one line two"}
    finally:
        s.close()


def test_no_systemd_is_a_no_op():
    n = ServiceNotifier.from_env({})
    assert not n.enabled and not n.ready() and not n.status("x") and not n.watchdog() and not n.stopping()


def test_a_vanished_socket_never_raises(listener):
    _, path = listener

    class Log:
        def __init__(self):
            self.warnings = []

        def warning(self, event, **kw):
            self.warnings.append((event, kw))

    log = Log()
    n = ServiceNotifier(path + ".gone", watchdog_s=0.0, log=log)
    assert not n.ready() and not n.watchdog()
    assert [e for e, _ in log.warnings] == ["sd_notify_failed"], "logged once, not every tick"


def test_watchdog_interval():
    assert watchdog_interval({"WATCHDOG_USEC": "120000000"}) == 60.0
    assert watchdog_interval({"WATCHDOG_USEC": "120000000", "WATCHDOG_PID": str(os.getpid())}) == 60.0
    assert watchdog_interval({"WATCHDOG_USEC": "120000000", "WATCHDOG_PID": "1"}, pid=2) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({}) is None


def test_watchdog_pings_at_most_each_interval():
    t = [0.0]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"oom-supervisor-wd-{os.getpid()}"
    s.bind("\0" + name)
    try:
        n = ServiceNotifier("@" + name, watchdog_s=10.0, clock=lambda: t[0])
        sent = []
        for t[0] in (0.0, 1.0, 9.9, 10.0, 15.0, 20.5):
            sent.append(n.watchdog())
        assert sent == [True, False, False, True, False, True]
    finally:
        s.close()


def test_status_line_is_one_bounded_line():
    line = status_line(running=2, queued=0, waiting=1, paused="x\n" * 500)
    assert "\n" not in line and len(line) <= 200 and line.startswith("2 running, 0 queued, 1 waiting")


def test_status_from_the_record(tmp_path):
    from .night import build_night

    _, store = build_night(tmp_path)
    assert status_from_store(store, running=1) == "1 running, 1 queued"
    store.set_meta("queue_paused", "job 2: disk full on /data")
    assert status_from_store(store, running=0) == "0 running, 1 queued; queue PAUSED: job 2: disk full on /data"
