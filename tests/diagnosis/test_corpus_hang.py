"""A run that stopped making progress with no error, told by a pasted log alone (issue 29): it stops
while the model's shards load or the process group forms, and nothing follows. Before this change
it read as 'no failure evidence'. Logs copied from development-part excerpts of bench/corpus."""

from supervisor.core.models import Category, ExitRecord
from supervisor.judge.diagnosis import diagnose_bytes
from tests.diagnosis.test_trust import sample_block

# pytorch/pytorch#68104 (hang_pytorch_lightning_ddp_stuck_initializing)
LIGHTNING_68104 = (
    b"GPU available: True, used: True\n"
    b"TPU available: False, using: 0 TPU cores\n"
    b"LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: [0,1]\n"
    b"Using native 16bit precision.\n"
    b"LOCAL_RANK: 1 - CUDA_VISIBLE_DEVICES: [0,1]\n"
    b"Using native 16bit precision.\n"
    b"initializing ddp: GLOBAL_RANK: 1, MEMBER: 2/2\n"
    b"initializing ddp: GLOBAL_RANK: 0, MEMBER: 1/2\n"
)
# lm-sys/FastChat#587 (hang_fastchat_vicuna_loading_shards_zero_percent)
FASTCHAT_587 = (
    b"init_kwargs {'torch_dtype': torch.float16, 'device_map': 'sequential', 'max_memory': {0: '12GiB', 1: '12GiB',"
    b" 2: '12GiB', 3: '12GiB'}}\n"
    b"Loading checkpoint shards:   0%|      | 0/3 [00:00<?, ?it/s]\n"
)


def test_a_pasted_log_that_stops_while_starting_is_a_hang():
    for log in (LIGHTNING_68104, FASTCHAT_587):
        d = diagnose_bytes(log, None)
        assert d.category is Category.HANG, d.summary
        assert d.strength == "hint"


def test_with_an_exit_status_or_after_a_printed_sample_it_is_not():
    """The supervisor knows how its own attempts ended (its hang stop decides those); a sample is text."""
    for log in (LIGHTNING_68104, FASTCHAT_587):
        assert diagnose_bytes(log, ExitRecord(returncode=0)).category is Category.SUCCESS
        assert diagnose_bytes(log, ExitRecord(returncode=1)).category is Category.UNKNOWN
    # LLaMA-Factory's sample print, the log's last lines: its text is never the program's last word.
    # (A bar at a line start ends a sample's skip in the scanner, so the open one quotes no bar.)
    open_sample = (b"training example:\ninput_ids:\n[151644, 8948, 198]\ninputs:\n" + LIGHTNING_68104
                   + b"label_ids:\n[-100, 2610]\nlabels:\n" + LIGHTNING_68104)
    for log in (sample_block(FASTCHAT_587), sample_block(LIGHTNING_68104), open_sample):
        d = diagnose_bytes(log, None)
        assert d.category is Category.UNKNOWN, d.summary


def test_a_pasted_log_that_ends_on_a_training_bar_is_not_a_hang():
    """The excerpt stops, not necessarily the run (a healthy report often ends on its bar)."""
    bars = b"".join(b"  %d%%|#   | %d/100 [00:10<00:10,  5.00it/s]\n" % (i, i) for i in range(1, 9))
    assert diagnose_bytes(bars, None).category is Category.UNKNOWN


def test_other_start_up_lines_it_stops_at():
    """Beyond the corpus: newer Lightning's start-up line; c10d waiting for the other ranks."""
    for log in (b"Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2\n",
                (b"INFO:torch.distributed.distributed_c10d:Waiting in store based barrier to initialize process group"
                b" for rank: 0, key: store_based_barrier_key:1 (world_size=2, worker_count=1, timeout=0:30:00)\n")):
        assert diagnose_bytes(log, None).category is Category.HANG
