"""The surroundings, not the job: DNS, the Hub, proxies, TLS. A transient failure: retried."""

from __future__ import annotations

import re

from supervisor.core.models import Category
from supervisor.judge.diagnosis.hits import HINT, ROOT, Hit, Segment

# A bare timeout or dropped connection raised inside the HTTP stack (CPython's socket/ssl/http.client,
# urllib3, requests, aiohttp, httpx): a connect or read that got no answer. The scanner asks this of a
# generic exception's last frame (the same exception raised by the program itself is not one).
_NET_EXC = frozenset({"TimeoutError", "timeout", "ConnectionAbortedError", "BrokenPipeError"})
_NET_FRAME_RE = re.compile(  # either path separator: a Windows traceback names C:\...\lib\ssl.py
    r"(?:^|[/\\])(?:urllib3|requests|aiohttp|httpx|httpcore)[/\\]|(?:^|[/\\])(?:socket|ssl)\.py$"
    r"|(?:^|[/\\])http[/\\]client\.py$"
)


def network_frame(exc: str | None, last_frame_path: str) -> Hit | None:
    """An environment hit for a generic timeout whose last frame is the HTTP stack's own, else None."""
    if exc is None or exc.rsplit(".", 1)[-1] not in _NET_EXC or not _NET_FRAME_RE.search(last_frame_path):
        return None
    return Hit("environment", Category.ENVIRONMENT, ROOT, "network", exc=exc)

# --- environment (transient: the network, the hub, DNS) -------------------
_ENV_RE = re.compile(
    r"Temporary failure in name resolution|NameResolutionError|Failed to resolve|Name or service not known"
    r"|ReadTimeoutError|ConnectTimeoutError|MaxRetryError|ConnectionError|ConnectionResetError|Connection aborted"
    r"|We couldn't connect to '?https?://|couldn't connect to|Network is unreachable|HTTP Error 50[234]"
    # requests' raise_for_status ('%s Server Error: %s for url: %s'), any 5xx; huggingface_hub re-raises it
    r"|\b5\d\d Server Error\b"
    # the resolver's own words (socket.gaierror: glibc's gai_strerror, Windows' WSA 11001); transformers'
    # wrapper of any hub HTTPError left after not-found/gated/entry errors were told apart
    r"|getaddrinfo failed|There was a specific connection error when trying to load"
    r"|check your connection|Please check your connection|Internet connection|SSLError|ProxyError"
    r"|\bReadTimeout\b|\bConnectTimeout\b|Read timed out|ConnectionRefusedError|urlopen error"
    r"|429 Client Error|Could not resolve host"
    # a connection dropped mid-response (urllib3's ProtocolError, requests, http.client), aiohttp's own
    # classes, a TLS chain that does not verify
    r"|ChunkedEncodingError|Connection broken: |RemoteDisconnected|Remote end closed connection without response"
    r"|ClientConnectorError|Cannot connect to host|ServerDisconnectedError|ClientPayloadError"
    r"|CERTIFICATE_VERIFY_FAILED"
    # a gateway or service saying it is down (google.api_core's ServiceUnavailable, any status line)
    r"|\bServiceUnavailable\b|\b50[234] (?:Service (?:Temporarily )?Unavailable|Bad Gateway|Gateway Time-?out)\b"
)
# urllib3/requests' own account of a request that never got an answer (huggingface_hub logs it as a
# warning, "'(MaxRetryError(...))' thrown while requesting HEAD ..."): the network failed, said
# outside any exception line; a hint, read when nothing stronger explains the end.
_HTTP_FAIL_RE = re.compile(
    r"Max retries exceeded with url|Failed to establish a new connection"
    r"|Caused by (?:NewConnection|ConnectTimeout|ReadTimeout|NameResolution|Proxy|SSL)Error"
    # urllib3's own timeout messages (connectionpool.py, connection.py), in whatever a caller wrapped them
    r"|Read timed out\. \(read timeout\b|timed out\. \(connect timeout="
    # curl, git and wget say a failed lookup in their own words
    r"|Could not resolve host|failed: (?:Temporary failure in name resolution|Name or service not known)"
)
# LocalEntryNotFoundError under HF_HUB_OFFLINE (or local_files_only) means "not cached": a config error.
_OFFLINE_RE = re.compile(r"outgoing traffic has been disabled|HF_HUB_OFFLINE|local_files_only=True|offline mode")


def find(seg: Segment, t: str, exc: str | None, exc_form: bool, hits: list[Hit]) -> bool:
    """Append this family's hits for one segment (`t` its text, `exc` its short exception class).
    True when no later family may speak (a network failure is not a config error)."""
    if exc == "CommError" and exc_form and "wandb" in (seg.exc or ""):
        # wandb/errors/errors.py: "Error communicating with W&B servers" (init timed out, network errors)
        hits.append(Hit("environment", Category.ENVIRONMENT, ROOT, "network", exc=seg.exc))
        return True
    # Transient environment failures, before config: a hub lookup that failed for want of a network.
    # (A connection between ranks - c10d store, rendezvous, NCCL - stays a comm failure.)
    if (not _ENV_RE.search(t) or _OFFLINE_RE.search(t)
            or any(h.category is Category.COMM_FAILURE for h in hits)):
        return False
    if exc_form or "LocalEntryNotFoundError" in t:
        hits.append(Hit("environment", Category.ENVIRONMENT, ROOT, "network", exc=seg.exc))
        return True
    if _HTTP_FAIL_RE.search(t):
        # A warning (the hub may still fall back to its cache): a mention, decisive as the log's final
        # error, else read only when no other line explains the end.
        hits.append(Hit("environment_mention", Category.ENVIRONMENT, HINT, "network"))
        return True
    return False
