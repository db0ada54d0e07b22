"""The edge of the pre-launch checks: read what `preflight.check` needs, nothing else.

Bounded and never raising: a path that cannot be looked at (permissions, a hung mount's
error) is UNKNOWN, which never refuses; JSON files are read up to a size cap. The
Hugging Face cache is read the way huggingface_hub lays it out (`models--org--name/refs/
<revision>` holds the snapshot's commit, `snapshots/<commit>/config.json` the file), so
the daemon needs no ML library to tell whether a model is there.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from supervisor.intake import preflight as pf

MAX_JSON_BYTES = 16 << 20  # LLaMA-Factory's own dataset_info.json is ~30 KB
MAX_ROUNDS = 4


def path_kind(path: str) -> str:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return pf.MISSING
    except NotADirectoryError:
        return pf.MISSING
    except OSError as exc:
        return pf.MISSING if exc.errno in (errno.ENOENT, errno.ENOTDIR) else pf.UNKNOWN
    if stat.S_ISDIR(st.st_mode):
        return pf.DIR
    return pf.FILE if stat.S_ISREG(st.st_mode) else pf.OTHER


def read_json(path: str) -> pf.JsonRead:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        return pf.JsonRead(error=pf.MISSING)
    except IsADirectoryError:
        return pf.JsonRead(error="is a folder")
    except OSError as exc:
        return pf.JsonRead(error=pf.MISSING if exc.errno == errno.ENOTDIR else pf.UNKNOWN)
    if len(data) > MAX_JSON_BYTES:
        return pf.JsonRead(error=f"larger than {MAX_JSON_BYTES >> 20} MiB")
    try:
        return pf.JsonRead(value=json.loads(data.decode("utf-8")))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return pf.JsonRead(error=str(exc)[:200])


def hub_cache_dir(env: Mapping[str, str]) -> str:
    """huggingface_hub's HF_HUB_CACHE for an environment."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return os.path.expanduser(env[var])
    home = env.get("HF_HOME")
    if not home:
        xdg = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
        home = os.path.join(xdg, "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def hub_snapshot(repo: str, *, cache_dir: str, revision: str = "main") -> str | None:
    """The cached snapshot folder of a Hub model that has its config.json, or None."""
    folder = os.path.join(cache_dir, "models--" + repo.replace("/", "--"))
    commit = revision
    try:
        with open(os.path.join(folder, "refs", revision)) as f:
            commit = f.read(200).strip()
    except OSError:
        pass
    snap = os.path.join(folder, "snapshots", commit)
    return snap if os.path.isfile(os.path.join(snap, "config.json")) else None


def job_env(base: Mapping[str, str], daemon_env: Mapping[str, str], job_env_: Mapping[str, str]) -> dict[str, str]:
    """The environment an attempt gets: the daemon's (here: `base`), its config's `env`, the job's."""
    return {**base, **daemon_env, **job_env_}


def gather(config: Mapping[str, Any] | None, *, workdir: str, env: Mapping[str, str], after: Sequence[int] = (),
           launch_here: bool = True, jobs: Mapping[int, pf.JobFact] | None = None,
           where: str = "submit") -> pf.Facts:
    """Read every fact the checks of `config` ask for (in rounds: a registry before its files)."""
    facts = pf.Facts(env=dict(env), launch_here=launch_here, jobs=jobs, where=where,
                     hub_cache=hub_cache_dir(env))
    out = output_dir_of(config, workdir, env)
    facts.output_dir = realpath_prefix(out) if out else None
    for _ in range(MAX_ROUNDS):
        want = pf.wanted(config, workdir=workdir, facts=facts, after=after)
        if not want:
            break
        for p in want.paths:
            facts.paths[p] = path_kind(p)
        for p in want.json:
            facts.json[p] = read_json(p)
        for repo, cache_dir, revision in want.hub:
            try:
                facts.hub[(repo, cache_dir, revision)] = hub_snapshot(
                    repo, cache_dir=cache_dir or facts.hub_cache, revision=revision)
            except OSError:
                facts.hub[(repo, cache_dir, revision)] = False  # type: ignore[assignment]  # unknown
    return facts


def output_dir_of(config: Mapping[str, Any] | None, workdir: str, env: Mapping[str, str] | None = None) -> str | None:
    out = (config or {}).get("output_dir") if isinstance(config, Mapping) else None
    if not isinstance(out, str) or not out:
        return None
    return pf.resolve(workdir, out, env)


def realpath_prefix(path: str) -> str:
    """`path` with its longest existing prefix resolved (symlinks), so two spellings of one folder match."""
    p = Path(path)
    tail: list[str] = []
    while not p.exists() and p.parent != p:
        tail.append(p.name)
        p = p.parent
    try:
        base = p.resolve()
    except OSError:
        return path
    return os.path.normpath(os.path.join(base, *reversed(tail)))
