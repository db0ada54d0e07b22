"""`oom-supervisor explain`: run() with parsed args, JSON and human output, bad input."""

from __future__ import annotations

import argparse
import io
import json

from supervisor.diagnosis import explain
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
