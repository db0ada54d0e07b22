"""Tell people what happened: run the configured commands with the event as JSON on stdin.

Commands (daemon-wide in the config, per job in `supervisor.notify`) are argv
lists, run without a shell and without blocking the loop; a command that fails
or hangs is logged and killed after a timeout, never retried in a loop. Use
`notify-send`, `mail`, or a script of your own. Webhooks (`webhooks:` in the config) get the
same events over HTTP from background threads (webhooks.py).
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

from supervisor.service.webhooks import Webhooks

NOTIFY_TIMEOUT_S = 30.0
WEBHOOK_FLUSH_S = 10.0  # at shutdown: what is still queued gets this long


class Notifier:
    def __init__(self, specs, *, log, webhooks=()) -> None:
        self.specs = list(specs)
        self.log = log
        self.pending: list[tuple[subprocess.Popen, float, list[str]]] = []
        self.webhooks = Webhooks(webhooks, log=log) if webhooks else None

    def send(self, event: dict[str, Any]) -> None:
        job_specs = event.pop("_job_notify", None) or []
        self.reap()
        self.log.info("notify", **{("notify_event" if k == "event" else k): v
                                   for k, v in event.items() if k != "changes"})
        if self.webhooks is not None:
            self.webhooks.send(event)
        payload = (json.dumps(event, default=str) + "\n").encode()
        for spec in [*self.specs, *job_specs]:
            if event.get("event") not in spec.on:
                continue
            try:
                p = subprocess.Popen(spec.command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
                try:
                    p.stdin.write(payload)
                    p.stdin.close()
                except BrokenPipeError:
                    pass
                self.pending.append((p, time.monotonic() + NOTIFY_TIMEOUT_S, spec.command))
            except OSError as exc:
                self.log.warning("notify_failed", command=spec.command, error=str(exc))

    def reap(self, *, wait: bool = False) -> None:
        """Collect finished commands; with wait (shutdown), also flush webhooks (bounded)."""
        if wait and self.webhooks is not None:
            self.webhooks.close(WEBHOOK_FLUSH_S)
            self.webhooks = None
        still = []
        for p, deadline, cmd in self.pending:
            if wait:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            rc = p.poll()
            if rc is None and time.monotonic() > deadline:
                p.kill()
                p.wait()
                self.log.warning("notify_timeout", command=cmd)
            elif rc is None:
                still.append((p, deadline, cmd))
            elif rc != 0:
                self.log.warning("notify_command_failed", command=cmd, returncode=rc)
        self.pending = still
