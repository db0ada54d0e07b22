"""Rules generalised from the development part of batch r9b (issue 29): what an expert reads in a
stranger's log, not the words of one excerpt. Log text below is written from the libraries' own
output formats (CPython's traceback module, Ray's raylet report), cited per case."""

from supervisor.core.models import Category
from supervisor.judge.diagnosis import diagnose_bytes


def test_a_timeout_raised_in_the_http_stack_on_windows_is_environment():
    """The stdlib's `TimeoutError: The read operation timed out` (ssl.py's read) ends a traceback whose
    frames are Windows paths (`C:\\...\\lib\\ssl.py`): the same network timeout as on Linux (bench r9b
    environment_lora_easy_*). The same class raised by the program's own code stays a crash."""
    frames = (b'  File "C:\\Users\\u\\AppData\\Local\\Programs\\Python\\Python310\\lib\\socket.py", line 705, in readinto\n'
              b"    return self._sock.recv_into(b)\n"
              b'  File "C:\\Users\\u\\AppData\\Local\\Programs\\Python\\Python310\\lib\\ssl.py", line 1130, in read\n'
              b"    return self._sslobj.read(len, buffer)\n")
    exc = b"TimeoutError: The read operation timed out\n"
    d = diagnose_bytes(b"Traceback (most recent call last):\n" + frames + exc, None)
    assert d.category is Category.ENVIRONMENT, d.summary
    own = b'Traceback (most recent call last):\n  File "D:\\train\\wait.py", line 9, in <module>\n    poll()\n' + exc
    assert diagnose_bytes(own, None).category is not Category.ENVIRONMENT


def test_an_exception_just_above_a_chain_marker_ended_a_traceback():
    """CPython's traceback module prints "During handling of the above exception, another exception
    occurred:" only after a whole traceback, so the exception line right above it ended one even when
    the paste kept none of its `File` lines (bench r9b dev: a Ray actor's PytorchStreamWriter failure
    whose frames were cut, then DeepSpeed's save frames). Text lines between them and it stays a hint."""
    p = b"(ActorModelRayActorBOX pid=4994) "
    cut = (p + b"    zip_file.write_record(name, storage, num_bytes)\n"
           + p + b"RuntimeError: [enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing"
           b" file data/0: file write failed\n")
    chain = (p + b"\n" + p + b"During handling of the above exception, another exception occurred:\n" + p + b"\n"
             + p + b"ray::CriticModelRayActor.save_checkpoint() (pid=4999, ip=172.24.40.143)\n"
             + p + b'  File "/site-packages/deepspeed/runtime/engine.py", line 3170, in save_checkpoint\n'
             + p + b"    self._save_zero_checkpoint(save_dir, tag)\n")
    d = diagnose_bytes(cut + chain, None)
    assert d.category is Category.DISK_FULL, d.summary
    assert d.strength != "hint"
    # The marker must follow the exception closely: an earlier text line is not promoted.
    far = cut + b"".join(p + b"step %d loss 0.1\n" % i for i in range(5)) + chain
    assert diagnose_bytes(far, None).category is not Category.DISK_FULL


def test_any_enumerated_list_of_possible_causes_is_a_hedge():
    """Ray's raylet words its dead-worker report two ways across releases: "There are some potential
    root causes. (1) ..." and "Some common causes include: (1) the process was killed by the OOM killer
    ..., (2) ray stop --force was called, or (3) the worker crashed unexpectedly due to SIGSEGV" (bench
    r8 dev, verl). Neither names a fact; a single cause after "(1)" with no "(2)" is not a list."""
    report = (b"(raylet) A worker died or was killed while executing a task by an unexpected system error. To"
              b" troubleshoot the problem, check the logs for the dead worker. Worker PID: 87687 Worker exit type:"
              b" SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of"
              b" file. Some common causes include: (1) the process was killed by the OOM killer due to high memory"
              b" usage, (2) ray stop --force was called, or (3) the worker crashed unexpectedly due to SIGSEGV or"
              b" another unexpected error.\n")
    d = diagnose_bytes(report, None)
    assert d.category is Category.UNKNOWN, d.summary
    single = b"Segmentation fault. Possible causes: (1) a bad build of the extension\n"
    assert diagnose_bytes(single, None).category is Category.CRASH_OTHER


_SPAWN_TB = (b"Traceback (most recent call last):\n"
             b'  File "main.py", line 422, in <module>\n    join=True)\n'
             b'  File "/env/lib/python3.7/site-packages/torch/multiprocessing/spawn.py", line 146, in join\n'
             b"    signal_name=name\n")


def test_mp_spawn_reporting_a_childs_death_is_a_relay():
    """torch/multiprocessing/spawn.py raises ProcessExitedException("process %d terminated with signal %s")
    or ("... with exit code %d") in the PARENT when a child died without a Python error: how it ended,
    never why: a signal or an exit code alone is unknown (like torchrun's `exitcode : -11`), not a crash
    of the program's own. (SIGKILL's reading is the project's kill convention, left as it is.)"""
    for end in (b"signal SIGSEGV", b"signal SIGABRT", b"exit code 1"):
        log = _SPAWN_TB + b"torch.multiprocessing.spawn.ProcessExitedException: process 0 terminated with " + end + b"\n"
        d = diagnose_bytes(log, None)
        assert d.category is Category.UNKNOWN, (end, d.summary)
    # The child's own error, printed by spawn above its ProcessRaisedException, still decides.
    child = (b"-- Process 0 terminated with the following error:\nTraceback (most recent call last):\n"
             b'  File "train.py", line 9, in run\n    x = cfg["lr"]\nKeyError: \'lr\'\n')
    assert diagnose_bytes(child, None).category is not Category.UNKNOWN


def test_checkpoint_writers_failing_without_enospc_words_are_disk_evidence():
    """Writers that report a failed write in their own words, at save time (issue 29: "a writer error at
    save time is disk evidence"): torch's PyTorchStreamWriter::setup `"File ", file_name, " cannot be
    opened."` and its valid() check `"PytorchStreamWriter failed " + what` (opening archive, writing
    central directory...), numpy's ndarray.tofile short write `"%ld requested and %ld written"`
    (numpy/_core/src/multiarray/convert.c). Statvfs still overrules them where it was measured."""
    save = b'Traceback (most recent call last):\n  File "/env/site-packages/torch/serialization.py", line 422, in save\n'
    save += b"    with _open_zipfile_writer(f) as opened_zipfile:\n"
    tofile = (b'Traceback (most recent call last):\n  File "/env/site-packages/numpy/lib/format.py", line 719,'
              b" in write_array\n    array.tofile(fp)\n")
    for log in (save + b"RuntimeError: File my_out/checkpoints/checkpoint_0.pt cannot be opened.\n",
                save + b"RuntimeError: [enforce fail at inline_container.cc:319] . PytorchStreamWriter failed opening"
                       b" archive.\n",
                tofile + b"OSError: 524288 requested and 0 written\n"):
        d = diagnose_bytes(log, None)
        assert d.category is Category.DISK_FULL, d.summary
    # The same writer failing in C++ (a TorchScript save): the abort's what() names it.
    cxx = (b"terminate called after throwing an instance of 'c10::Error'\n  what():  File /out/x.pt cannot be opened.\n"
           b"Aborted (core dumped)\n")
    assert diagnose_bytes(cxx, None).category is Category.DISK_FULL
    # A reader's complaint or the phrase in prose is not a writer failing.
    assert diagnose_bytes(b"INFO: the config file says 3 requested and 2 written samples\n", None).category \
        is not Category.DISK_FULL


def test_other_launchers_relaying_a_childs_signal_are_unknown():
    """Launchers and IDEs that report how a child ended, in their own words (how, never why; cf.
    torchrun's `exitcode : -11`): Open MPI's help-mpirun.txt "%s noticed that process rank %d with PID %d
    on node %s exited on signal %d (%s).", Slurm srun's "srun: error: %s: task %d: %s" (strsignal),
    PyCharm's "Process finished with exit code 139 (interrupted by signal 11: SIGSEGV)", and torchrun's
    own SignalException when the agent is sent SIGTERM from outside. A shell's own segfault line with
    nothing else stays a crash."""
    for log in (
        b"mpirun noticed that process rank 3 with PID 0 on node gpu01 exited on signal 11 (Segmentation fault).\n",
        b"srun: error: gpu-node-03: task 2: Segmentation fault (core dumped)\n",
        b"srun: error: gpu-node-03: task 0: Aborted\n",
        b"Epoch 3:  45%|####5     | 450/1000\n\nProcess finished with exit code 139 (interrupted by signal 11: SIGSEGV)\n",
        (b'Traceback (most recent call last):\n  File "/env/site-packages/torch/distributed/elastic/multiprocessing/api.py",'
         b' line 62, in _terminate_process_handler\n    raise SignalException(f"Process {os.getpid()} got signal: {sigval}",'
         b" sigval=sigval)\ntorch.distributed.elastic.multiprocessing.api.SignalException: Process 4123 got signal: 15\n"),
    ):
        d = diagnose_bytes(log, None)
        assert d.category is Category.UNKNOWN, (log[-60:], d.summary)
    assert diagnose_bytes(b"Segmentation fault (core dumped)\n", None).category is Category.CRASH_OTHER


def test_a_traceback_flattened_into_one_line_is_still_read():
    """A paste whose newlines were lost (a web form, a logger joining lines) carries the header
    "Traceback (most recent call last):" far into one long line: that is not a header behind a line
    prefix (prefixes.MAX_PREFIX), and the rest of the line must still be read (bench r6 dev, LLaVA's
    worker: urllib3's ConnectTimeoutError then huggingface_hub's LocalEntryNotFoundError, one line)."""
    words = (b"2023-10-06 05:57:22 | ERROR | stderr | requests.exceptions.ConnectTimeout: (MaxRetryError(\"HTTPSConnectionPool"
             b"(host='huggingface.co', port=443): Max retries exceeded with url: /x/resolve/main/config.json (Caused by"
             b" ConnectTimeoutError(<urllib3.connection.HTTPSConnection object at 0x7f>, 'Connection to huggingface.co"
             b" timed out. (connect timeout=10)'))\") 2023-10-06 05:57:22 | ERROR | stderr | The above exception was the"
             b" direct cause of the following exception: 2023-10-06 05:57:22 | ERROR | stderr | Traceback (most recent"
             b" call last): 2023-10-06 05:57:22 | ERROR | stderr | File \"/env/site-packages/transformers/utils/hub.py\","
             b" line 417, in cached_file 2023-10-06 05:57:22 | ERROR | stderr | resolved_file = hf_hub_download("
             b" 2023-10-06 05:57:22 | ERROR | stderr | huggingface_hub.utils._errors.LocalEntryNotFoundError: An error"
             b" happened while trying to locate the file on the Hub and we cannot find the requested files in the local"
             b" cache.\n")
    d = diagnose_bytes(words, None)
    assert d.category is Category.ENVIRONMENT, d.summary


def test_the_oom_reapers_line_is_the_kernels_oom_kill_too():
    """mm/oom_kill.c prints "oom_reaper: reaped process %d (%s), now anon-rss:%lukB, ..." only for a
    victim the OOM killer just killed: pasted alone from dmesg it is host-memory evidence like "Out of
    memory: Killed process"."""
    log = b"[2059992.056260] oom_reaper: reaped process 25315 (python3), now anon-rss:0kB, file-rss:74732kB, shmem-rss:12296kB\n"
    d = diagnose_bytes(log, None)
    assert d.category is Category.HOST_OOM and d.strength != "hint", d.summary


def test_an_error_raised_while_the_c10d_store_forms_is_a_comm_failure():
    """Where it was raised says what failed: a RuntimeError out of torch.distributed's store creation
    (rendezvous.py `_create_c10d_store` -> TCPStore(...), TCPStore.cpp's "Stop_waiting response is
    expected" protocol check, or any of elastic/rendezvous/'s store calls) is the group not forming, in
    whatever words; a ValueError from the same module's env checks (MASTER_ADDR not set) is not."""
    store = (b'Traceback (most recent call last):\n  File "/env/site-packages/torch/distributed/rendezvous.py",'
             b" line 189, in _create_c10d_store\n    return TCPStore(\n")
    d = diagnose_bytes(store + b"RuntimeError: Stop_waiting response is expected\n", None)
    assert d.category is Category.COMM_FAILURE, d.summary
    elastic = (b'Traceback (most recent call last):\n  File "/env/site-packages/torch/distributed/elastic/rendezvous/'
               b'c10d_rendezvous_backend.py", line 113, in _call_store\n    return getattr(self._store, store_op)(*args)\n')
    assert diagnose_bytes(elastic + b"RuntimeError: unexpected EOF\n", None).category is Category.COMM_FAILURE
    env = (b'Traceback (most recent call last):\n  File "/env/site-packages/torch/distributed/rendezvous.py", line 240,'
           b" in _env_rendezvous_handler\n    master_addr = _get_env_or_raise(\"MASTER_ADDR\")\n"
           b"ValueError: Error initializing torch.distributed using env:// rendezvous: environment variable"
           b" MASTER_ADDR expected, but not set\n")
    assert diagnose_bytes(env, None).category is not Category.COMM_FAILURE


def test_a_tracking_or_storage_service_out_of_reach_is_environment():
    """The run's surroundings in their own classes and status lines: wandb's CommError ("Error
    communicating with W&B servers", wandb/errors/errors.py; e.g. "Run initialization has timed out"),
    google.api_core's ServiceUnavailable and any "503 Service Unavailable" / "502 Bad Gateway" /
    "504 Gateway Timeout" status line. A wandb usage error stays the user's."""
    for log in (b"wandb.errors.errors.CommError: Run initialization has timed out after 90.0 sec.\n",
                b"wandb.errors.CommError: Network error (ConnectionError), entering retry loop.\n",
                b"google.api_core.exceptions.ServiceUnavailable: 503 Service Unavailable\n",
                b"RuntimeError: upload failed: 504 Gateway Timeout\n"):
        d = diagnose_bytes(log, None)
        assert d.category is Category.ENVIRONMENT, (log, d.summary)
    usage = b"wandb.errors.UsageError: api_key not configured (no-tty). call wandb.login(key=[your_api_key])\n"
    assert diagnose_bytes(usage, None).category is not Category.ENVIRONMENT
