"""The daemon config's service keys (metrics, webhooks) and the shipped example config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from supervisor.daemon.config import ConfigError, default_dirs, load_config

REPO = Path(__file__).resolve().parents[2]


def load(tmp_path: Path, text: str):
    p = tmp_path / "daemon.yaml"
    p.write_text(text)
    return load_config(p, state_dir=tmp_path / "s", spool_dir=tmp_path / "p", env={})


def test_the_shipped_example_config_loads():
    """Regression: YAML 1.1 reads the key `on:` as the boolean True, so every `notify` entry in
    configs/daemon.yaml was refused with 'Keys should be strings'."""
    cfg = load_config(REPO / "configs/daemon.yaml", env={})
    assert cfg.notify[0].on == ["succeeded", "failed", "escalated", "paused"]
    # Issue 20 item 8: no webhook is enabled from a variable nothing sets; its example, uncommented, loads.
    assert cfg.webhooks == [] and cfg.mode == "single-user" and cfg.metrics.job_names is False
    text = (REPO / "configs/daemon.yaml").read_text()
    example = "\n".join(ln[2:] for ln in text.splitlines() if ln.startswith(("# webhooks:", "#   - url_env", "#     on:")))
    hooks = yaml.safe_load(example)["webhooks"]
    assert hooks[0]["url_env"] == "OOM_SUPERVISOR_WEBHOOK_URL"


def test_on_off_yes_no_keys_and_values(tmp_path):
    cfg = load(tmp_path, "webhooks: [{url_env: HOOK, on: [failed]}]\nnotify: [{command: [x], on: [paused]}]\n")
    assert cfg.webhooks[0].on == ["failed"] and cfg.notify[0].on == ["paused"]


def test_metrics_and_webhooks(tmp_path):
    cfg = load(tmp_path, "metrics: {textfile: m.prom}\nwebhooks: [{url_file: hook.url, timeout: 2s}]\n")
    assert cfg.metrics.address == "127.0.0.1:9839", "an empty metrics block serves localhost"
    assert cfg.metrics.textfile == (tmp_path / "m.prom").resolve(), "relative to the config file"
    assert cfg.webhooks[0].url_file == (tmp_path / "hook.url").resolve() and cfg.webhooks[0].timeout == 2
    assert load(tmp_path, "{}\n").metrics is None and load(tmp_path, "metrics:\n").metrics is None
    assert load(tmp_path, "metrics: {address: '[::1]:0'}\n").metrics.address == "[::1]:0"


@pytest.mark.parametrize("text, message", [
    ("metrics: {adress: x}\n", "metrics.adress: unknown key (did you mean 'address'?)"),
    ("metrics: {address: localhost}\n", "is not host:port"),
    ("metrics: {address: 'h:70000'}\n", "is not host:port"),
    ("webhooks: [{url_fle: x}]\n", "webhooks.0.url_fle: unknown key (did you mean 'url_file'?)"),
    ("webhooks: [{url_env: A, url_file: b}]\n", "exactly one of url_file"),
    ("webhooks: [{on: [failed]}]\n", "exactly one of url_file"),
    ("webhooks: [{url_env: A, on: [succeded]}]\n", "unknown event 'succeded'"),
    ("webhooks: [{url_env: A, timeout: 0}]\n", "must be more than 0 seconds"),
    ("webhooks: [{url: 'https://hooks.example/T0/B0/secret'}]\n", "webhooks.0.url: unknown key"),
])
def test_bad_service_config_is_refused_precisely(tmp_path, text, message):
    with pytest.raises(ConfigError) as err:
        load(tmp_path, text)
    assert message in str(err.value)
    assert "secret" not in str(err.value), "a URL given in the file is not echoed back"


def test_a_member_without_a_config_of_their_own_uses_the_system_service(tmp_path):
    """On a shared box `oom-supervisor submit` by a member of the submit group must reach the
    service's spool (/var/spool/...), not a private one under ~/.local that nobody reads."""
    home, system = tmp_path / "home", tmp_path / "etc" / "config.yaml"
    home.mkdir()
    env = {"HOME": str(home)}
    personal = (home / ".local/state/oom-supervisor", home / ".local/share/oom-supervisor/spool",
                home / ".config/oom-supervisor/config.yaml")
    assert default_dirs(root=False, system_config=system, env=env) == personal, "no system service"
    system.parent.mkdir()
    system.write_text("max_parallel: 2\n")
    assert default_dirs(root=False, system_config=system, env=env) == (
        Path("/var/lib/oom-supervisor"), Path("/var/spool/oom-supervisor"), system)
    personal[2].parent.mkdir(parents=True)
    personal[2].write_text("max_parallel: 3\n")
    assert default_dirs(root=False, system_config=system, env=env) == personal, "one's own config wins"
    assert default_dirs(root=True, system_config=system, env=env)[:2] == (
        Path("/var/lib/oom-supervisor"), Path("/var/spool/oom-supervisor"))
