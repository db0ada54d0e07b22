"""A kill the log reports, and nothing measured: `unknown`, with host_oom named first as where to look.

The shell's "Killed", torchrun's `exitcode: -9`, a launcher's `died with <Signals.SIGKILL: 9>` say that
a SIGKILL came, not who sent it: the kernel's OOM killer is the likeliest sender, an outside `kill -9`,
a scheduler or a watchdog possible. Called host_oom only with memory evidence (a cgroup's oom_kill
counter, a kernel OOM line, memory near exhaustion, the scheduler's OUT_OF_MEMORY, the supervisor's own
limit stop); without it `unknown` (which never triggers a remedy), and its "why not" names host_oom and
the kill line (issue 29). The excerpts are development-part excerpts of bench/corpus, copied with their
threads; the daemon itself nearly always has a measurement, so a night's verdict is rarely this one.
"""

from __future__ import annotations

import pytest

from supervisor.core.models import Category, ExitRecord, HostEvidence
from supervisor.judge.diagnosis import diagnose_bytes

# castorini/hedwig#70 (bench/corpus/c_oom/unknown_hedwig_killed_after_embedding_load)
SHELL_KILLED = (b"Note: You are using GPU for training\n"
                b"100%|##################| 3000001/3000001 [03:33<00:00, 14061.26it/s]\n"
                b"Killed\n")
# meta-llama/llama#856 (bench/corpus/c_oom/unknown_llama2_torchrun_exitcode_minus9_laptop)
TORCHRUN_MINUS_9 = (b"> initializing pipeline with size 1\n"
                    b"[2023-10-13 17:40:02,544] torch.distributed.elastic.multiprocessing.api: [ERROR] failed "
                    b"(exitcode: -9) local_rank: 0 (pid: 62498) of binary: /home/znr/miniconda3/envs/llama/bin/python\n")
# kohya-ss/sd-scripts#1476 (bench/corpus/r7/unknown_sd_scripts_flux_db_save_died_sigkill), its last line
ACCELERATE_DIED = (b"INFO saving checkpoint: train_util.py:5124\n"
                   b"Traceback (most recent call last):\n"
                   b"File \"/home/Ubuntu/apps/kohya_ss/venv/lib/python3.10/site-packages/accelerate/commands/launch.py\","
                   b" line 704, in simple_launcher\n"
                   b"raise subprocess.CalledProcessError(returncode=process.returncode, cmd=cmd)\n"
                   b"subprocess.CalledProcessError: Command '['/home/Ubuntu/apps/kohya_ss/venv/bin/python', "
                   b"'flux_train.py']' died with <Signals.SIGKILL: 9>.\n")
EXCERPTS = {"shell_killed": (SHELL_KILLED, None), "torchrun_minus_9": (TORCHRUN_MINUS_9, ExitRecord(-9, "SIGKILL")),
            "accelerate_died": (ACCELERATE_DIED, ExitRecord(-9, "SIGKILL"))}


@pytest.mark.parametrize("name", sorted(EXCERPTS))
def test_a_kill_with_nothing_measured_is_unknown_and_points_at_host_oom(name):
    log, exit = EXCERPTS[name]
    d = diagnose_bytes(log, exit)
    assert d.category is Category.UNKNOWN, d.summary
    assert "SIGKILL" in d.summary and "no host memory evidence" in d.summary, d.summary
    assert d.candidates and d.candidates[0].category is Category.HOST_OOM, d.candidates
    kill_line = log.decode().splitlines().index(next(ln for ln in log.decode().splitlines()
                                                     if "Killed" in ln or "-9" in ln or "SIGKILL" in ln)) + 1
    assert kill_line in [no for no, _ in d.candidates[0].lines], d.candidates[0]


@pytest.mark.parametrize("name", sorted(EXCERPTS))
def test_the_same_kill_with_memory_evidence_is_a_host_oom(name):
    log, exit = EXCERPTS[name]
    d = diagnose_bytes(log, exit or ExitRecord(-9, "SIGKILL"), HostEvidence(cgroup_oom_kills=1))
    assert d.category is Category.HOST_OOM and d.strength == "structural", d.summary


def test_the_same_kill_measured_without_memory_pressure_is_not_an_oom():
    d = diagnose_bytes(SHELL_KILLED, ExitRecord(-9, "SIGKILL"), HostEvidence(cgroup_oom_kills=0))
    assert d.category is Category.CRASH_OTHER and d.subkind == "sigkill_unexplained", d.summary


# hezhangsprinter/DCPDN#12 (bench/corpus, development part: host_oom_dcpdn_dataloader_worker_killed)
WORKER_KILLED = (b"  File \"/home/littlemonster/anaconda3/envs/pic/lib/python2.7/site-packages/torch/utils/data/"
                 b"dataloader.py\", line 175, in handler\n"
                 b"    _error_if_any_worker_fails()\n"
                 b"RuntimeError: DataLoader worker (pid 19597) is killed by signal: Killed.\n")


def test_one_dataloader_worker_killed_is_a_likely_host_oom():
    """The OOM killer picks one process; whoever else kills ends the job: one worker killed while its
    parent lived to report it is a likely host OOM (hint strength, said as not confirmed)."""
    d = diagnose_bytes(WORKER_KILLED, ExitRecord(1))
    assert (d.category, d.strength) == (Category.HOST_OOM, "hint"), d.summary
    assert "DataLoader worker alone" in d.summary and "not confirmed" in d.summary, d.summary
