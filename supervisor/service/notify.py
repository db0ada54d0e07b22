"""Tell people what happened: run the configured commands with the event as JSON on stdin.

Commands (daemon-wide in the config, per job in `supervisor.notify`) are argv
lists, run without a shell and without blocking the loop; a command that fails
or hangs is logged and killed after a timeout, never retried in a loop. Use
`notify-send`, `mail`, or a script of your own. Webhooks (`webhooks:` in the config) get the
same events over HTTP from background threads (webhooks.py).

A job's own commands (its `supervisor.notify`) are the job's: on a shared box they run as its
submitter, with the job's clean environment (never the daemon's), like the job itself; without a
known submitter they do not run. The config's commands are the admin's and run as the daemon.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any

from supervisor.core.jobenv import inherited
from supervisor.run.identity import as_user_kwargs, myself
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
        identity = event.pop("_job_identity", None)
        if event.pop("_job_needs_identity", False) and identity is None and job_specs:
            self.log.warning("notify_job_commands_skipped", job=event.get("job"),
                             note="the job has no known submitter to run its commands as")
            job_specs = []
        self.reap()
        self.log.info("notify", **{("notify_event" if k == "event" else k): v
                                   for k, v in event.items() if k != "changes"})
        if self.webhooks is not None:
            self.webhooks.send(event)
        payload = (json.dumps(event, default=str) + "\n").encode()
        for spec, theirs in [*((s, False) for s in self.specs), *((s, True) for s in job_specs)]:
            if event.get("event") not in spec.on:
                continue
            how: dict[str, Any] = {}
            if theirs:  # the job's: as its user (a shared box), with its clean environment
                how = {**as_user_kwargs(identity), "cwd": "/",
                       "env": {**inherited(os.environ), **(identity or myself()).login_env()}}
            try:
                p = subprocess.Popen(spec.command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True, **how)
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
