"""The control socket of a real daemon in system mode, used by real users through the real CLI:
everyone sees every job in `status`; `show`, `logs`, `cancel`, `retry` only work on one's own jobs
(or for root and the admin group); who asks is the kernel's word (SO_PEERCRED). Bounded and
robust: malformed, oversized, slow and too many requests get errors, never a dead server."""

from __future__ import annotations

import json
import socket
import time

import pytest


@pytest.fixture
def running(box):
    b = box().start()
    alice = b.submit("alice", "alices-run", {"command": ["sh", "-c", "echo hello from alice; sleep 60"]})
    bob = b.submit("bob", "bobs-run", {"command": ["sh", "-c", "echo hello from bob; sleep 60"]},
                   extra={})
    b.wait_state(alice, "running")
    return b, alice, bob


def _raw(b, payload: bytes, *, user_timeout: float = 10) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(user_timeout)
        s.connect(str(b.socket))
        if payload:
            s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    return json.loads(buf)


def test_status_shows_every_job_with_its_owner_but_details_only_of_ones_own(running):
    b, alice, bob = running
    res = b.cli("bob", "status", "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["id"]: r for r in json.loads(res.stdout)}
    assert (rows[alice]["owner"], rows[alice]["name"]) == ("alice", "alices-run")
    assert rows[alice]["state"] in ("running", "queued") and "reason" not in rows[alice]
    assert rows[bob]["owner"] == "bob" and "reason" in rows[bob], "his own job in full"
    table = b.cli("bob", "status")
    assert "alice" in table.stdout and "OWNER" in table.stdout


def test_bob_cannot_show_read_or_cancel_alices_job(running):
    b, alice, _ = running
    b.wait_for(lambda: "hello from alice" in b.cli("alice", "logs", str(alice)).stdout, 30, "alice's log")
    for cmd in (["show", str(alice)], ["logs", str(alice)], ["cancel", str(alice)], ["retry", str(alice)],
                ["watch", str(alice)]):
        res = b.cli("bob", *cmd)
        assert res.returncode == 2, (cmd, res.stdout, res.stderr)
        assert "alice's, not yours" in res.stderr and "hello from alice" not in res.stdout
    assert b.cli("bob", "unpause").returncode == 2
    assert b.status()[0]["state"] == "running", "bob's cancel did nothing"
    # alice can; so can an admin (oscar) and root.
    assert json.loads(b.cli("alice", "show", str(alice), "--json").stdout)["owner"] == "alice"
    assert json.loads(b.cli("oscar", "show", str(alice), "--json").stdout)["name"] == "alices-run"
    assert "hello from alice" in b.cli("oscar", "logs", str(alice)).stdout
    res = b.cli("alice", "cancel", str(alice))
    assert res.returncode == 0 and "cancel requested" in res.stdout
    b.wait_state(alice, "cancelled", 30)
    events = json.loads(b.cli("root", "show", str(alice), "--json").stdout)["events"]
    assert any("cancel requested by alice" in e["message"] for e in events)
    # her live views through the socket end with the job: watch (1: not succeeded), logs -f
    watch = b.cli("alice", "watch", str(alice), "--interval", "0.2")
    assert watch.returncode == 1 and "alices-run" in watch.stdout
    follow = b.cli("alice", "logs", str(alice), "-f")
    assert follow.returncode == 0 and "hello from alice" in follow.stdout


def test_outsiders_get_nothing(running):
    b, _alice, _ = running
    res = b.cli("eve", "status")
    assert res.returncode == 2 and "may not use this supervisor" in res.stderr and "alices-run" not in res.stdout


def test_malformed_oversized_slow_and_flooding_requests_get_errors_and_the_server_goes_on(running):
    b, alice, _ = running
    assert _raw(b, b"not json\n")["error"] == "the request is not JSON"
    assert "JSON object" in _raw(b, b"[1, 2]\n")["error"]
    assert "unknown request" in _raw(b, b'{"op": "rm -rf"}\n')["error"]
    assert "job id" in _raw(b, b'{"op": "show", "job": "1; DROP TABLE jobs"}\n')["error"]
    assert "byte counts" in _raw(b, json.dumps({"op": "logs", "job": alice, "offset": -5}).encode() + b"\n")["error"]
    assert "over 65536 bytes" in _raw(b, b'{"op": "status", "x": "' + b"a" * 100_000 + b'"}\n')["error"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as slow:  # says nothing at all
        slow.settimeout(15)
        slow.connect(str(b.socket))
        t = time.monotonic()
        assert "no complete request" in json.loads(slow.recv(4096))["error"] and time.monotonic() - t < 10
    refused = 0
    for _ in range(150):
        r = _raw(b, b'{"op": "status"}\n')
        refused += not r["ok"] and "too many requests" in r["error"]
    assert refused > 0, "a flood is rate limited"
    time.sleep(1.5)
    assert b.cli("root", "status").returncode == 0 and b.cli("alice", "status", "--json").returncode == 0
    assert b.proc.poll() is None
