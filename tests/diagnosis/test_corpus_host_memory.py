"""Host memory refused in the OS's or Arrow's words (issue 29, development part of bench/corpus):
a fork failing with ENOMEM, Arrow's allocator failing. Both were called crash_other. The texts
below are copied from the excerpts named."""

from supervisor.core.models import Category, ExitRecord
from supervisor.judge.diagnosis import diagnose_bytes

# host_oom_graphormer_fork_errno12 (microsoft/Graphormer#7)
FORK = (
    b"OSError: [Errno 12] Cannot allocate memory\n"
    b"    self.pid = os.fork()\n"
    b"OSError: [Errno 12] Cannot allocate memory\n"
    b"OSError: [Errno 12] Cannot allocate memory\n"
)
# host_oom_img2dataset_arrow_realloc_failed (rom1504/img2dataset#443)
ARROW = (
    b"Traceback (most recent call last):\n"
    b'  File "/home/u202320081001041/miniconda3/envs/XVLM/lib/python3.7/multiprocessing/pool.py", line 748, in next\n'
    b"    raise value\n"
    b"pyarrow.lib.ArrowMemoryError: realloc of size 2172846080 failed\n"
)


def test_enomem_and_arrow_allocator_failures_are_host_oom():
    for name, log in (("fork", FORK), ("arrow", ARROW)):
        d = diagnose_bytes(log, ExitRecord(returncode=1))
        assert d.category is Category.HOST_OOM, (name, d.summary)


def test_the_same_words_printed_while_training_goes_on_do_not_act():
    printed = b"retrying after: OSError: [Errno 12] Cannot allocate memory was logged by a worker\n"
    log = printed + b"{'loss': 1.2, 'learning_rate': 1e-05, 'epoch': 0.1}\n"
    assert diagnose_bytes(log, ExitRecord(returncode=0)).category is Category.SUCCESS
    assert diagnose_bytes(log, ExitRecord(returncode=1)).category is not Category.HOST_OOM
