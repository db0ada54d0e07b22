"""Daemon configuration, layered: defaults < config file < environment < CLI.

The file is YAML and strict (unknown keys refused with a suggestion), like job
files. Defaults follow the FHS when running as root and XDG folders otherwise,
so the demo needs no root.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from supervisor import SOURCE_ROOT
from supervisor.core.paths import SpoolPaths, StatePaths
from supervisor.intake.jobspec import NotifySpec, parse_duration, parse_size, suggest

ENV_STATE = "OOM_SUPERVISOR_STATE_DIR"
ENV_SPOOL = "OOM_SUPERVISOR_SPOOL_DIR"
ENV_CONFIG = "OOM_SUPERVISOR_CONFIG"


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


EVENT_KINDS = ("succeeded", "failed", "escalated", "paused", "cancelled", "retry", "interrupted",
               "vram_not_released")


def _address(v: str) -> str:
    """'host:port' or '[v6]:port'; port 0 asks the kernel for a free one (tests)."""
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{v!r} is not host:port (e.g. 127.0.0.1:9839, [::1]:9839)")
    return v


class MetricsSpec(BaseModel):
    """Prometheus metrics: an HTTP endpoint and/or a node-exporter textfile (both optional)."""

    model_config = ConfigDict(extra="forbid")
    address: str | None = "127.0.0.1:9839"   # null: no HTTP endpoint
    textfile: Path | None = None             # e.g. /var/lib/node-exporter/oom_supervisor.prom
    interval: float = 15.0                   # seconds between textfile rewrites
    # Job names as a label of the per-job series. Off: the endpoint answers any local user (and the
    # textfile is world-readable for node-exporter), and a name can say what someone trains; the job
    # id is there to look it up with `status`.
    job_names: bool = False

    @field_validator("address")
    @classmethod
    def _addr(cls, v: str | None) -> str | None:
        return None if v is None else _address(v)

    @field_validator("interval", mode="before")
    @classmethod
    def _dur(cls, v: Any) -> Any:
        return parse_duration(v)


class WebhookSpec(BaseModel):
    """POST each event as JSON (plus a `text` chat apps show). The URL holds the secret, so it
    comes from a file or an environment variable, never from this (often world-readable) file."""

    model_config = ConfigDict(extra="forbid")
    url_file: Path | None = None
    url_env: str | None = None
    on: list[str] = Field(default_factory=lambda: ["succeeded", "failed", "escalated", "paused"])
    timeout: float = 10.0
    retries: int = Field(default=4, ge=0, le=20)

    @field_validator("timeout", mode="before")
    @classmethod
    def _dur(cls, v: Any) -> Any:
        v = parse_duration(v)
        if v <= 0:
            raise ValueError("must be more than 0 seconds")
        return v

    @field_validator("on")
    @classmethod
    def _events(cls, v: list[str]) -> list[str]:
        bad = [e for e in v if e != "*" and e not in EVENT_KINDS]
        if bad:
            raise ValueError(f"unknown event {bad[0]!r}; known: {', '.join(EVENT_KINDS)} (or '*')")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> WebhookSpec:
        if (self.url_file is None) == (self.url_env is None):
            raise ValueError("give exactly one of url_file (a file holding the URL, mode 0600) "
                             "or url_env (an environment variable holding it)")
        return self


SYSTEM_CONFIG = Path("/etc/oom-supervisor/config.yaml")
SYSTEM_DIRS = (Path("/var/lib/oom-supervisor"), Path("/var/spool/oom-supervisor"))


def default_dirs(*, root: bool | None = None, system_config: Path = SYSTEM_CONFIG,
                 env: dict[str, str] | None = None) -> tuple[Path, Path, Path]:
    """(state, spool, config file) for this user: the system's as root, XDG folders otherwise,
    except for a user without a config of their own on a box where the system service is
    installed: `submit` must reach that service's spool, not a private one nobody reads."""
    if _is_root() if root is None else root:
        return (*SYSTEM_DIRS, SYSTEM_CONFIG)
    env = os.environ if env is None else env
    home = Path(env.get("HOME") or Path.home())
    state = Path(env.get("XDG_STATE_HOME") or home / ".local/state") / "oom-supervisor"
    data = Path(env.get("XDG_DATA_HOME") or home / ".local/share") / "oom-supervisor" / "spool"
    conf = Path(env.get("XDG_CONFIG_HOME") or home / ".config") / "oom-supervisor" / "config.yaml"
    if not conf.exists() and system_config.exists():
        return (*SYSTEM_DIRS, system_config)
    return state, data, conf


class DaemonConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    state_dir: Path | None = None
    spool_dir: Path | None = None
    default_policy: str = "default"
    policy_dirs: list[Path] = Field(default_factory=list)
    launcher: list[str] = Field(default_factory=lambda: ["llamafactory-cli"])
    max_parallel: int = Field(default=1, ge=1)
    poll_interval: float = Field(default=1.0, gt=0)
    settle_time: float = 2.0
    max_job_file_bytes: int = 1024 * 1024
    stop_grace: float = 30.0
    fatal_grace: float = 0.5
    hang_timeout: float = Field(default=1800.0, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    notify: list[NotifySpec] = Field(default_factory=list)
    webhooks: list[WebhookSpec] = Field(default_factory=list)
    metrics: MetricsSpec | None = None       # `metrics: {}` serves 127.0.0.1:9839
    on_restart: str = "adopt"
    cgroups: str = "auto"
    # Where no cgroup can be made: a PID namespace per attempt as its owner (root only).
    pid_namespace: str = "auto"
    # An attempt's log past this size keeps its head and its latest part (see shim.py).
    max_log_bytes: int = Field(default=1 << 30, ge=1 << 20)
    # Attempts in a row cut short by a supervisor crash before the job is failed (a job that
    # crashes the supervisor or the box would otherwise loop forever: interruptions cost no budget).
    max_interruptions: int = Field(default=5, ge=1)
    # How long the next attempt on the same GPUs waits for the previous one's VRAM to be given back
    # (drivers free a dead process's memory late); 0 turns the wait off.
    vram_release_timeout: float = Field(default=60.0, ge=0)
    # The box's GPUs for jobs that ask for a count (`gpus: N`): probed when omitted (sysfs,
    # nvidia-smi, rocm-smi); a list here names them (also a stand-in for tests).
    gpu_devices: list[int] | None = None
    gpu_vendor: str = "auto"
    # Where attempts run: on this box (local) or each as one Slurm job (slurm:, see slurm.py).
    backend: str = "local"
    slurm: dict[str, Any] | None = None
    # Who jobs run as. system: each job as the user who submitted it (the daemon runs as root: a
    # shared box; the system unit says `daemon --mode system`); single-user: as the daemon's own
    # user, whose files alone it takes (a workstation, `systemctl --user`, a daemon run by hand).
    mode: str = "single-user"
    # System mode: members of submit_group may submit; root and members of admin_group may see and
    # control every job through the control socket (others: their own jobs, and `status` of all).
    submit_group: str = "oom-supervisor-submit"
    admin_group: str = "oom-supervisor-admin"
    # System mode: attempt folders (log, rendered config, the job's own scratch folder), outside the
    # state folder so their owner can read them while the state stays root's alone. Default: beside
    # the state folder, `<state_dir>-attempts`.
    attempts_dir: Path | None = None
    # The query and control socket (system mode; SO_PEERCRED tells who asks). null: none.
    control_socket: Path | None = Path("/run/oom-supervisor/control.sock")
    # Names from the daemon's environment a job gets besides the allowlist (PATH, LANG, LC_*, TZ,
    # proxies, CA bundles, GPU visibility): e.g. [LD_LIBRARY_PATH, CUDA_HOME]. A name ending in '*'
    # is a prefix. Secrets of the daemon (webhook URLs) are never passed, even if listed.
    pass_env: list[str] = Field(default_factory=list)

    @field_validator("max_log_bytes", mode="before")
    @classmethod
    def _logsize(cls, v: Any) -> Any:
        return parse_size(v)

    @field_validator("poll_interval", "settle_time", "vram_release_timeout", "stop_grace", "fatal_grace", "hang_timeout",
                     mode="before")
    @classmethod
    def _dur(cls, v: Any) -> Any:
        return parse_duration(v)

    @field_validator("on_restart")
    @classmethod
    def _restart(cls, v: str) -> str:
        if v not in ("adopt", "stop"):
            raise ValueError("must be 'adopt' (keep following a still-running attempt) or 'stop'")
        return v

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        if v not in ("local", "slurm"):
            raise ValueError("must be 'local' (attempts run on this box) or 'slurm' (each attempt is an sbatch job)")
        return v

    @field_validator("slurm")
    @classmethod
    def _slurm(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            from supervisor.intake.slurm_request import SlurmSettings

            SlurmSettings.model_validate(v)  # its own strict schema; errors name the key
        return v

    @property
    def slurm_settings(self):
        from supervisor.intake.slurm_request import SlurmSettings

        return SlurmSettings.model_validate(self.slurm or {})

    @field_validator("mode")
    @classmethod
    def _mode(cls, v: str) -> str:
        if v not in ("system", "single-user"):
            raise ValueError("must be 'system' (each job runs as its submitter; the daemon is root) "
                             "or 'single-user' (jobs run as the daemon's user)")
        return v

    @property
    def system_mode(self) -> bool:
        """Jobs run as their submitters (the daemon is root)."""
        return self.mode == "system"

    @property
    def attempts_root(self) -> Path | None:
        """Where attempt folders live: None means inside each job's folder in the state (single-user)."""
        if not self.system_mode:
            return self.attempts_dir
        assert self.state_dir is not None
        return self.attempts_dir or self.state_dir.with_name(self.state_dir.name + "-attempts")

    @field_validator("gpu_vendor")
    @classmethod
    def _vendor(cls, v: str) -> str:
        if v not in ("auto", "amd", "nvidia", "unknown"):
            raise ValueError("must be auto, amd, nvidia or unknown")
        return v

    @field_validator("cgroups", "pid_namespace")
    @classmethod
    def _cg(cls, v: str) -> str:
        if v not in ("auto", "off"):
            raise ValueError("must be 'auto' or 'off'")
        return v

    @property
    def state(self) -> StatePaths:
        assert self.state_dir is not None
        return StatePaths(self.state_dir, attempts=self.attempts_root)

    @property
    def spool(self) -> SpoolPaths:
        assert self.spool_dir is not None
        return SpoolPaths(self.spool_dir)

    def policy_search_dirs(self) -> list[Path]:
        shipped = SOURCE_ROOT / "policies"
        return [*self.policy_dirs, Path("/etc/oom-supervisor/policies"), shipped]


_SECTIONS = {"webhooks": WebhookSpec, "metrics": MetricsSpec, "notify": NotifySpec}


class ConfigError(ValueError):
    pass


class _Loader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true/false. YAML 1.1 also reads on/off/yes/no as booleans, which
    turned every `on:` key (notify, webhooks) into True."""


_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def load_config(path: Path | None = None, *, state_dir: Path | None = None,
                spool_dir: Path | None = None, env: dict[str, str] | None = None,
                system_config: Path = SYSTEM_CONFIG, mode: str | None = None) -> DaemonConfig:
    env = dict(os.environ) if env is None else env
    d_state, d_spool, d_conf = default_dirs(system_config=system_config)
    explicit = path or (Path(env[ENV_CONFIG]) if env.get(ENV_CONFIG) else None)
    conf_path = explicit or d_conf
    data: dict[str, Any] = {}
    if conf_path.exists():
        try:
            data = yaml.load(conf_path.read_text(), Loader=_Loader) or {}  # a SafeLoader subclass
        except yaml.YAMLError as exc:
            raise ConfigError(f"{conf_path}: YAML does not parse: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{conf_path}: must be a mapping")
    elif explicit:
        raise ConfigError(f"{conf_path}: no such config file")
    if mode is not None:
        data = {**data, "mode": mode}
    try:
        cfg = DaemonConfig.model_validate(data)
    except ValidationError as err:
        msgs = []
        for e in err.errors():
            key = ".".join(str(x) for x in e["loc"])
            if e["type"] == "extra_forbidden":
                model = _SECTIONS.get(str(e["loc"][0]), DaemonConfig) if len(e["loc"]) > 1 else DaemonConfig
                hint = suggest(str(e["loc"][-1]), tuple(model.model_fields))
                msgs.append(f"{key}: unknown key" + (f" (did you mean {hint!r}?)" if hint else ""))
            else:
                msgs.append(f"{key}: {e['msg']}")
        raise ConfigError(f"{conf_path}: " + "; ".join(msgs)) from None
    base = conf_path.parent  # relative secret/textfile paths: next to the config file
    for hook in cfg.webhooks:
        if hook.url_file is not None:
            hook.url_file = (base / hook.url_file.expanduser()).resolve()
    if cfg.metrics is not None and cfg.metrics.textfile is not None:
        cfg.metrics.textfile = (base / cfg.metrics.textfile.expanduser()).resolve()
    if cfg.attempts_dir is not None:
        cfg.attempts_dir = cfg.attempts_dir.expanduser().resolve()
    # Absolute: attempts run with cwd=workdir, so paths into the state folder must not be relative.
    cfg.state_dir = Path(state_dir or env.get(ENV_STATE) or cfg.state_dir or d_state).expanduser().resolve()
    cfg.spool_dir = Path(spool_dir or env.get(ENV_SPOOL) or cfg.spool_dir or d_spool).expanduser().resolve()
    return cfg
