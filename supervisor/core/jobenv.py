"""What a job inherits from the daemon's environment: an allowlist, nothing else.

The daemon's environment is not the job's: it holds the daemon's secrets (a webhook URL read with
`url_env`), its own settings (`OOM_SUPERVISOR_*`, `NOTIFY_SOCKET`, `INVOCATION_ID`) and, run by hand,
whatever the shell that started it had. A job starts from the names below (what a program needs to
find its tools, speak the locale, reach the network through a proxy and trust its CA, and see the
box's GPUs), plus the names the admin lists in `pass_env:`; then come the config's `env:`, the job's
own `env:`, its user's identity and what the remedy sets. A name of a daemon secret is never passed,
listed or not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

ALLOWED = frozenset({
    "PATH", "LANG", "LANGUAGE", "TZ",
    "http_proxy", "https_proxy", "no_proxy", "all_proxy", "ftp_proxy",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "FTP_PROXY",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    # the box's GPUs as the daemon was given them (the daemon narrows them per job)
    "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
})
ALLOWED_PREFIXES = ("LC_",)


def _listed(name: str, names: Iterable[str]) -> bool:
    return any(name == n or (n.endswith("*") and name.startswith(n[:-1])) for n in names)


def inherited(environ: Mapping[str, str], *, pass_env: Iterable[str] = (), secrets: Iterable[str] = ()) -> dict[str, str]:
    """The part of the daemon's `environ` a job starts from: the allowlist and `pass_env` (a name,
    or a prefix ending in '*'), never a name in `secrets` nor one of the daemon's own."""
    pass_env, secrets = list(pass_env), set(secrets)
    out = {}
    for k, v in environ.items():
        if k in secrets or k.startswith("OOM_SUPERVISOR_"):
            continue
        if k in ALLOWED or k.startswith(ALLOWED_PREFIXES) or _listed(k, pass_env):
            out[k] = v
    return out
