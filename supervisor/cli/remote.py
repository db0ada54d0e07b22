"""The CLI's side of the control socket (service/control.py): for a user who cannot read the
record (a shared box: the state folder is root's), `status`, `show`, `logs`, `watch`, `cancel`,
`retry` and `submit --wait` ask the daemon, which checks with the kernel who is asking."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

MAX_REPLY = 16 << 20
TIMEOUT_S = 30.0


class RemoteError(Exception):
    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def can_read_record(state) -> bool:
    """Whether this process can open the record itself (root; the daemon's own user)."""
    if not os.path.lexists(state.root):
        return True  # nothing recorded yet: nothing to ask the daemon either
    if not os.access(state.root, os.R_OK | os.X_OK):
        return False
    return not state.db.exists() or os.access(state.db, os.R_OK | os.W_OK)


class Remote:
    def __init__(self, path: Path) -> None:
        self.path = path

    def call(self, op: str, **args: Any) -> Any:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(TIMEOUT_S)
                s.connect(str(self.path))
                s.sendall(json.dumps({"op": op, **args}).encode() + b"\n")
                buf = b""
                while len(buf) <= MAX_REPLY:
                    chunk = s.recv(1 << 16)
                    if not chunk:
                        break
                    buf += chunk
        except FileNotFoundError:
            raise RemoteError(f"no supervisor answers at {self.path} (is the service running?)") from None
        except OSError as exc:
            raise RemoteError(f"cannot reach the supervisor at {self.path}: {exc.strerror or exc}") from None
        try:
            reply = json.loads(buf)
        except ValueError:
            raise RemoteError(f"the supervisor at {self.path} sent no answer") from None
        if not reply.get("ok"):
            raise RemoteError(str(reply.get("error")), int(reply.get("code") or 1))
        return reply.get("result")
