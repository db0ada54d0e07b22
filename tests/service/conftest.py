"""Helpers for the service tests: the real logger with its lines captured, a real local HTTP server."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import structlog.testing

from supervisor.service.logsetup import log


class CapturedLog:
    """The daemon's real structlog logger, its lines captured (structlog.testing).

    structlog's capture is process-wide: a sender thread left over from an earlier test on the
    same worker logs into it too. The logger handed out carries a token of its own, and only the
    lines with that token count (what the code under test logs through what it was given)."""

    def __init__(self, entries: list[dict]) -> None:
        self.token = object()
        self.log = log.bind(capture=self.token)
        self._all = entries

    @property
    def entries(self) -> list[dict]:
        return [e for e in self._all if e.get("capture") is self.token]

    def events(self, level: str | None = None) -> list[str]:
        return [e["event"] for e in self.entries if level is None or e["log_level"] == level]

    def text(self) -> str:
        return repr([{k: v for k, v in e.items() if k != "capture"} for e in self.entries])


class Server:
    """A real HTTP server on 127.0.0.1: `fail_first` 500s, then 200; `hang` holds each request."""

    def __init__(self, *, fail_first: int = 0, hang: bool = False, status: int = 200) -> None:
        self.bodies: list[bytes] = []
        self.paths: list[str] = []
        self.calls = 0
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                outer.calls += 1
                outer.paths.append(self.path)
                if hang:
                    outer.release.wait(10)
                    return
                if outer.calls <= fail_first:
                    self.send_response(500)
                    self.end_headers()
                    return
                outer.bodies.append(body)
                self.send_response(status)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def http_server():
    made: list[Server] = []

    def make(**kw) -> Server:
        s = Server(**kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture
def rlog():
    with structlog.testing.capture_logs() as entries:
        yield CapturedLog(entries)
