"""`oom-supervisor explain`: run() with parsed args, JSON and human output, bad input."""

from __future__ import annotations

import argparse
import io
import json

from supervisor.cli import explain
from tests.diagnosis.cases import FIXTURES


def _run(argv):
    parser = argparse.ArgumentParser(prog="oom-supervisor explain")
    explain.configure(parser)
    out, err = io.StringIO(), io.StringIO()
    rc = explain.run(parser.parse_args(argv), out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


def test_json_prints_one_object_with_the_diagnosis():
    rc, out, err = _run([str(FIXTURES / "gpu_oom_hip_mi300x_torchrun_rank3.log"), "--exit-code", "1", "--json"])
    assert rc == 0 and err == ""
    d = json.loads(out)  # exactly one JSON document
    assert out.count("\n") == 1
    assert d["category"] == "gpu_oom" and d["subkind"] == "allocator" and d["vendor"] == "hip"
    assert d["phase"] == "train_step" and d["rank"] == 3
    assert d["numbers"]["tried_to_allocate"] == round(3.91 * 2**30)
    assert d["evidence"][0]["rule"] == "torch_oom" and d["evidence"][0]["line_no"] > 0


def test_human_output_shows_units_bytes_evidence_lines_and_summary():
    rc, out, _ = _run([str(FIXTURES / "gpu_oom_cuda_pt22_private_pools_ansi.log"), "--exit-code", "1"])
    assert rc == 0
    assert "category : gpu_oom" in out and "subkind  : allocator" in out and "vendor   : cuda" in out
    assert "phase    : train_step" in out
    assert "546.00 MiB (572,522,496 bytes)" in out
    assert "line 42" in out and "[torch_oom]" in out
    assert "summary  : GPU out of memory" in out


def test_signal_flag_makes_a_bare_kill_unexplained_not_host_oom():
    rc, out, _ = _run([str(FIXTURES / "host_oom_cgroup_kill_137.log"), "--signal", "KILL", "--json"])
    assert rc == 0
    d = json.loads(out)
    assert d["category"] == "crash_other" and d["subkind"] == "sigkill_unexplained"


def test_exit_code_137_alone_is_read_as_sigkill():
    rc, out, _ = _run([str(FIXTURES / "host_oom_cgroup_kill_137.log"), "--exit-code", "137", "--json"])
    assert rc == 0 and json.loads(out)["subkind"] == "sigkill_unexplained"


def test_without_exit_info_the_log_alone_decides():
    rc, out, _ = _run([str(FIXTURES / "config_unknown_keys_torchrun.log"), "--json"])
    assert rc == 0 and json.loads(out)["category"] == "config_error"


def test_missing_file_is_a_clear_error_with_status_2(tmp_path):
    missing = tmp_path / "nope.log"
    rc, out, err = _run([str(missing)])
    assert rc == 2 and out == ""
    assert "not found" in err and str(missing) in err


def test_directory_and_bad_signal_are_bad_input(tmp_path):
    assert _run([str(tmp_path)])[0] == 2
    rc, _, err = _run([str(FIXTURES / "success_exit0.log"), "--signal", "SIGNOPE"])
    assert rc == 2 and "unknown signal" in err


def test_empty_log_is_diagnosed_not_refused(tmp_path):
    p = tmp_path / "empty.log"
    p.write_bytes(b"")
    rc, out, _ = _run([str(p), "--exit-code", "1", "--json"])
    assert rc == 0 and json.loads(out)["category"] == "unknown"


# --- the evidence a user has for a past run (issue 10) ----------------------------------------
def test_kernel_log_and_exit_status_make_a_sigkill_a_host_oom(tmp_path):
    dmesg = tmp_path / "dmesg.txt"
    dmesg.write_text("[812345.1] eth0: link up\n[812345.9] Memory cgroup out of memory: Killed process 48213 (python3) "
                     "total-vm:41234567kB, anon-rss:1240000kB\n")
    rc, out, _ = _run([str(FIXTURES / "host_oom_cgroup_kill_137.log"), "--exit-code", "137",
                       "--kernel-log", str(dmesg), "--json"])
    d = json.loads(out)
    assert rc == 0 and d["category"] == "host_oom" and d["strength"] == "structural"
    assert any(e["rule"] == "host:kernel_oom" and "48213" in e["text"] for e in d["evidence"])


def test_cgroup_counter_flag_corroborates_a_kill():
    rc, out, _ = _run([str(FIXTURES / "host_oom_cgroup_kill_137.log"), "--signal", "SIGKILL",
                       "--cgroup-oom-kills", "2", "--json"])
    assert rc == 0
    d = json.loads(out)
    assert d["category"] == "host_oom" and "oom_kill counter = 2" in d["summary"]


def test_slurm_states_are_read(tmp_path):
    log = str(FIXTURES / "host_oom_cgroup_kill_137.log")
    want = {"OUT_OF_MEMORY": "host_oom", "TIMEOUT": "unknown", "PREEMPTED": "unknown", "CANCELLED": "unknown",
            "NODE_FAIL": "environment", "DEADLINE": "unknown", "BOOT_FAIL": "environment"}
    for state, category in want.items():
        rc, out, err = _run([log, "--slurm-state", state.lower(), "--exit-code", "137", "--json"])
        assert rc == 0, err
        d = json.loads(out)
        assert d["category"] == category, (state, d["summary"])
        assert state in d["summary"]


def test_free_bytes_confirm_or_refute_a_full_disk():
    log = str(FIXTURES / "disk_full_checkpoint_save.log")
    rc, out, _ = _run([log, "--exit-code", "1", "--free-bytes", "/data/out=1048576", "--json"])
    assert rc == 0 and json.loads(out)["category"] == "disk_full"
    rc, out, _ = _run([log, "--exit-code", "1", "--free-bytes", "/data/out=500GiB", "--json"])
    assert rc == 0
    d = json.loads(out)
    assert d["category"] == "crash_other" and d["strength"] == "hint" and "statvfs disagrees" in d["summary"]


def test_bad_evidence_flags_are_clear_errors(tmp_path):
    log = str(FIXTURES / "success_exit0.log")
    for argv, msg in (
        (["--free-bytes", "/data"], "--free-bytes wants PATH=BYTES"),
        (["--free-bytes", "/data=lots"], "--free-bytes /data=lots: 'lots' is not a size"),
        (["--slurm-state", "EXPLODED"], "unknown --slurm-state 'EXPLODED'"),
        (["--kernel-log", str(tmp_path / "missing.txt")], "kernel log not found"),
        (["--cgroup-oom-kills", "-1"], "--cgroup-oom-kills must be >= 0"),
    ):
        rc, _out, err = _run([log, *argv])
        assert rc == 2 and msg in err, (argv, err)


# --- issue 29: the "why not" of an unknown verdict ----------------------------------------------

# A DEVELOPMENT-part corpus excerpt labelled unknown (unknown_deepspeed_gptj_killing_subprocess_before_
# optimizer_states.log), copied verbatim: DeepSpeed's launcher kills its worker with no error said.
GPTJ_KILLED = (
    b"[2/2] c++ flatten_unflatten.o -shared -L/usr/local/lib/python3.8/dist-packages/torch/lib -lc10 -ltorch_cpu"
    b" -ltorch -ltorch_python -o utils.so\n"
    b"Loading extension module utils...\n"
    b"Time to load utils op: 16.887123346328735 seconds\n"
    b"Rank: 0 partition count [1] and sizes[(6049711186, False)]\n"
    b"[2023-04-07 13:08:55,468] [INFO] [utils.py:829:see_memory_usage] Before initializing optimizer states\n"
    b"[2023-04-07 13:08:55,469] [INFO] [utils.py:830:see_memory_usage] MA 11.76 GB         Max_MA 11.76 GB      "
    b"   CA 11.77 GB         Max_CA 12 GB \n"
    b"[2023-04-07 13:08:55,469] [INFO] [utils.py:838:see_memory_usage] CPU Virtual Memory:  used = 28.43 GB, "
    b"percent = 22.6%\n"
    b"[2023-04-07 13:09:33,201] [INFO] [launch.py:318:sigkill_handler] Killing subprocess 80\n"
)


def test_unknown_names_the_two_likeliest_categories_with_their_lines_in_json(tmp_path):
    log = tmp_path / "gptj.log"
    log.write_bytes(GPTJ_KILLED)
    rc, out, _ = _run([str(log), "--exit-code", "1", "--json"])
    d = json.loads(out)
    assert rc == 0 and d["category"] == "unknown"
    assert [c["category"] for c in d["candidates"]] == ["host_oom", "gpu_oom"]
    host, gpu = d["candidates"]
    assert [x["line"] for x in host["lines"]] == [7, 8] and "Killing subprocess 80" in host["lines"][1]["text"]
    assert gpu["lines"] == [{"line": 6, "text": GPTJ_KILLED.decode().splitlines()[5].strip()}]


def test_unknown_candidates_print_verbatim_in_the_human_report():
    """A fixture labelled unknown: an OOM the program survived (training went on) and its traceback.
    Its `[INFO]`-like text must print as itself (plain text, never markup)."""
    rc, out, _ = _run([str(FIXTURES / "negative_oom_logged_with_traceback_then_progress.log"), "--exit-code", "1"])
    assert rc == 0 and "category : unknown" in out
    why = out[out.index("why not  :"):]
    raw = (FIXTURES / "negative_oom_logged_with_traceback_then_progress.log").read_bytes()
    lines = raw.decode().split("\n")  # the scanner's lines: a progress bar's \r does not end one
    assert why.splitlines()[1] == "  gpu_oom" and f"line 40 {lines[39].strip()}" in why
    assert "  crash_other" in why and f"line 21 {lines[20].strip()}" in why


def test_a_certain_verdict_has_no_candidates():
    _, out, _ = _run([str(FIXTURES / "gpu_oom_hip_mi300x_torchrun_rank3.log"), "--exit-code", "1", "--json"])
    assert json.loads(out)["candidates"] == [] and "why not" not in _run(
        [str(FIXTURES / "gpu_oom_hip_mi300x_torchrun_rank3.log"), "--exit-code", "1"])[1]


def test_show_says_where_to_look_for_an_unknown_attempt_verbatim():
    from rich.console import Console

    from supervisor.cli.show import attempt_panel
    from supervisor.core.models import Category, Diagnosis
    from supervisor.judge.diagnosis import diagnose_bytes

    log = GPTJ_KILLED.replace(b"Killing subprocess 80", b"Killing subprocess [bold]80[/bold]")
    d = diagnose_bytes(log, None, None)
    assert d.category == Category.UNKNOWN
    assert Diagnosis.from_dict(d.to_dict()) == d  # stored and read back as it was
    console = Console(record=True, width=300)
    console.print(attempt_panel({"number": 1, "started_at": 0, "ended_at": 1, "diagnosis": d.to_dict()}))
    text = console.export_text()
    assert ("unknown; most likely: host_oom (line 8: [2023-04-07 13:09:33,201] [INFO] "
            "[launch.py:318:sigkill_handler] Killing subprocess [bold]80[/bold]), gpu_oom (line 6: ") in text
