"""XLA on a TPU says its device ran out in its own words ("Attempting to reserve 6.48G at the bottom
of memory. That was not possible."), which no rule read: the log from pytorch/xla (bench/corpus,
development part) was called 'no failure evidence'."""

from supervisor.core.models import Category, ExitRecord
from supervisor.judge.diagnosis import diagnose_bytes

LOG = (
    b"2022-04-04 00:27:49.642380: E tensorflow/compiler/xla/xla_client/xla_util.cc:88]   (1) RESOURCE_EXHAUSTED: "
    b"Attempting to reserve 6.48G at the bottom of memory. That was not possible. There are 6.78G free, 0B reserved, "
    b"and 3.33G reservable.\n"
    b"2022-04-04 00:27:49.642385: E tensorflow/compiler/xla/xla_client/xla_util.cc:88] \t [[{{node XRTExecute}}]]\n"
)


def test_xla_cannot_reserve_device_memory_is_a_device_oom():
    d = diagnose_bytes(LOG, ExitRecord(returncode=1))
    assert d.category is Category.GPU_OOM, d.summary


def test_the_same_words_echoed_in_a_dataset_line_do_not_act():
    echoed = b"sample 12: 'the error said RESOURCE_EXHAUSTED: Attempting to reserve 1G at the bottom of memory'\n"
    assert diagnose_bytes(echoed, ExitRecord(returncode=0)).category is Category.SUCCESS
