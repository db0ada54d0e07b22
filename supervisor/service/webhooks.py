"""Webhooks: POST each event as JSON, plus a `text` field that Slack, Mattermost and Discord's
Slack-compatible endpoint (`.../slack`) show as the message.

`send` only enqueues: one worker thread per hook does the HTTP, with a timeout per try and
tenacity retries with backoff, so a slow or dead chat server never delays the loop (nor the other
hooks). Each queue is bounded; when full the oldest event is dropped, with a log line. The URL is
the secret (Slack's and Discord's URLs carry the token): it is read from a file or an environment
variable when sending, and never logged; errors are redacted before they are.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from tenacity import RetryError, Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from supervisor.service.escape import chat_text

QUEUE_SIZE = 200
USER_AGENT = "oom-supervisor-webhook/1"


class WebhookError(RuntimeError):
    """A failed try, with the URL already redacted out of the message."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def event_text(event: Mapping[str, Any]) -> str:
    """The one line a chat shows: 'job 3 (llama-lora) failed: <why>'. Names and messages come from
    job files and logs: escaped for the chat (`chat_text`), so they read as text and never ping or
    link; the event's other JSON fields stay exact for programs."""
    who = f"job {event.get('job')}" + (f" ({event['name']})" if event.get("name") else "")
    text = f"oom-supervisor: {who} {event.get('event', 'event')}"
    if event.get("message"):
        text += f": {event['message']}"
    return chat_text(text)


def payload(event: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in event.items() if not str(k).startswith("_")}
    body["text"] = event_text(event)
    return json.dumps(body, default=str).encode()


def redact(message: str, secret: str | None) -> str:
    if not secret:
        return message
    out = message.replace(secret, "<webhook url>")
    for part in secret.split("/")[3:]:  # path and query pieces can appear on their own
        if len(part) >= 6:
            out = out.replace(part, "<redacted>")
    return out


class Webhook:
    """One configured hook: its own bounded queue and worker thread."""

    def __init__(self, spec, index: int, *, log, env: Mapping[str, str] | None = None,
                 queue_size: int = QUEUE_SIZE, wait_max_s: float = 30.0) -> None:
        self.spec, self.log, self.env = spec, log, os.environ if env is None else env
        self.label = f"webhook[{index}] " + (f"url_env={spec.url_env}" if spec.url_env
                                              else f"url_file={spec.url_file}")
        self.queue: queue.Queue[bytes | None] = queue.Queue(maxsize=queue_size)
        self.wait_max_s = wait_max_s
        self.sent = self.failed = self.dropped = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name=self.label, daemon=True)
        self._thread.start()
        self._check_source()

    def _check_source(self) -> None:
        """Said at start-up, not at the first failure hours later: a URL that is not there, or a
        file others may read."""
        spec = self.spec
        if spec.url_env and not self.env.get(spec.url_env, "").strip():
            self.log.warning("webhook_url_missing", hook=self.label,
                             hint=f"set {spec.url_env} in the daemon's environment (the system unit reads "
                                  "/etc/oom-supervisor/supervisor.env, 0600); nothing is posted until then")
            return
        if spec.url_file is None:
            return
        try:
            if spec.url_file.stat().st_mode & 0o044:
                self.log.warning("webhook_url_file_readable_by_others", hook=self.label,
                                 hint=f"the URL is a secret: chmod 600 {spec.url_file}")
        except OSError as exc:
            self.log.warning("webhook_url_missing", hook=self.label,
                             hint=f"cannot read {spec.url_file}: {exc.strerror}; nothing is posted until it can be")

    def wants(self, kind: str | None) -> bool:
        return "*" in self.spec.on or kind in self.spec.on

    def put(self, body: bytes) -> None:
        """Never blocks: a full queue loses its oldest event, loudly."""
        with self._lock:
            while True:
                try:
                    self.queue.put_nowait(body)
                    return
                except queue.Full:
                    try:
                        self.queue.get_nowait()
                        self.queue.task_done()
                        self.dropped += 1
                        self.log.warning("webhook_queue_full_dropped_oldest", hook=self.label,
                                         dropped_total=self.dropped)
                    except queue.Empty:
                        pass

    def _url(self) -> str:
        if self.spec.url_env:
            url = self.env.get(self.spec.url_env, "").strip()
            if not url:
                raise WebhookError(f"environment variable {self.spec.url_env} is not set", retryable=False)
        else:
            try:
                url = self.spec.url_file.read_text().strip()
            except OSError as exc:
                raise WebhookError(f"cannot read {self.spec.url_file}: {exc.strerror}", retryable=False) from None
        if not url.startswith(("http://", "https://")):
            raise WebhookError(f"{self.label} does not hold an http(s) URL", retryable=False)
        return url

    def _post(self, url: str, body: bytes) -> None:
        req = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": USER_AGENT})
        try:
            with urllib.request.urlopen(req, timeout=self.spec.timeout) as resp:  # http(s) only: checked in _url
                resp.read(1 << 16)
        except urllib.error.HTTPError as exc:
            # 429 (rate limited) and 5xx are worth another try; other 4xx will not get better.
            raise WebhookError(redact(f"HTTP {exc.code} {exc.reason}", url),
                               retryable=exc.code == 429 or exc.code >= 500) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise WebhookError(redact(f"{type(reason).__name__}: {reason}", url), retryable=True) from None

    def deliver(self, body: bytes) -> bool:
        """Synchronously, with retries (the worker's job; public for tests and tools)."""
        started = time.monotonic()
        try:
            url = self._url()
            for attempt in Retrying(stop=stop_after_attempt(self.spec.retries + 1),
                                    wait=wait_exponential(multiplier=0.5, max=self.wait_max_s),
                                    retry=retry_if_exception(lambda e: isinstance(e, WebhookError) and e.retryable),
                                    reraise=True):
                with attempt:
                    self._post(url, body)
            self.sent += 1
            return True
        except (WebhookError, RetryError) as exc:
            self.failed += 1
            self.log.warning("webhook_failed", hook=self.label, error=str(exc),
                             seconds=round(time.monotonic() - started, 2))
            return False

    def _work(self) -> None:
        while True:
            body = self.queue.get()
            try:
                if body is None:
                    return
                self.deliver(body)
            except Exception:  # a bug here must not kill the worker silently
                self.log.exception("webhook_worker_error", hook=self.label)
            finally:
                self.queue.task_done()

    def close(self, timeout: float) -> bool:
        """Flush what is queued within `timeout`; True when the worker finished."""
        try:
            self.queue.put(None, timeout=max(0.0, timeout))
        except queue.Full:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()


class Webhooks:
    """All configured hooks. `send(event)` is what the loop calls: it returns at once."""

    def __init__(self, specs, *, log, env: Mapping[str, str] | None = None, **kw: Any) -> None:
        self.hooks = [Webhook(s, i, log=log, env=env, **kw) for i, s in enumerate(specs)]

    def send(self, event: Mapping[str, Any]) -> None:
        kind = event.get("event")
        wanted = [h for h in self.hooks if h.wants(kind)]
        if wanted:
            body = payload(event)
            for h in wanted:
                h.put(body)

    def close(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for h in self.hooks:
            h.close(max(0.0, deadline - time.monotonic()))
