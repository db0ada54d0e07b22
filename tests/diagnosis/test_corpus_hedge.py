"""Ray's dead-worker report lists possible causes (OOM killer, `ray stop --force`, SIGSEGV) without
choosing one: the segfault rule read "SIGSEGV" in that list as a fact and called it crash_other
(issue 29; OpenRLHF/OpenRLHF, development-part excerpt unknown_openrlhf_actor_died_connection_error
of bench/corpus, copied below)."""

from supervisor.core.models import Category, ExitRecord
from supervisor.judge.diagnosis import diagnose_bytes

RAY_DEAD_ACTOR = (
    b"The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail:"
    b" Worker unexpectedly exits with a connection error code 2. End of file. There are some potential root causes."
    b" (1) The process is killed by SIGKILL by OOM killer due to high memory usage. (2) ray stop --force is called."
    b" (3) The worker is crashed unexpectedly due to SIGSEGV or other unexpected errors.\n"
)


def test_a_list_of_possible_causes_is_no_evidence():
    for exit in (None, ExitRecord(returncode=1)):
        d = diagnose_bytes(RAY_DEAD_ACTOR, exit)
        assert d.category is Category.UNKNOWN, d.summary


def test_a_real_segfault_beside_it_still_speaks():
    log = RAY_DEAD_ACTOR + b"Fatal Python error: Segmentation fault\n"
    assert diagnose_bytes(log, ExitRecord(returncode=1)).category is Category.CRASH_OTHER
