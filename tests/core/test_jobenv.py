from supervisor.core.jobenv import inherited

DAEMON = {"PATH": "/usr/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC", "https_proxy": "http://p:3128",
          "SLACK_WEBHOOK_URL": "https://hooks.slack.com/services/T/B/secret", "OOM_SUPERVISOR_STATE_DIR": "/var/lib/x",
          "NOTIFY_SOCKET": "/run/systemd/notify", "HF_TOKEN": "hf_daemon", "LD_LIBRARY_PATH": "/opt/rocm/lib",
          "CUDA_HOME": "/usr/local/cuda", "HOME": "/root", "INVOCATION_ID": "abc", "CUDA_VISIBLE_DEVICES": "0,1"}


def test_only_the_allowlist_reaches_a_job():
    assert inherited(DAEMON) == {"PATH": "/usr/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC",
                                 "https_proxy": "http://p:3128", "CUDA_VISIBLE_DEVICES": "0,1"}


def test_pass_env_adds_names_and_prefixes_but_never_a_secret_or_the_daemons_own():
    got = inherited(DAEMON, pass_env=["LD_LIBRARY_PATH", "CUDA_*", "SLACK_WEBHOOK_URL", "OOM_SUPERVISOR_*"],
                    secrets=["SLACK_WEBHOOK_URL"])
    assert got["LD_LIBRARY_PATH"] == "/opt/rocm/lib" and got["CUDA_HOME"] == "/usr/local/cuda"
    assert "SLACK_WEBHOOK_URL" not in got and not any(k.startswith("OOM_SUPERVISOR_") for k in got)
    assert "HF_TOKEN" not in got and "HOME" not in got and "NOTIFY_SOCKET" not in got
