"""A job shaped like a torchrun launch: N ranks in their own sessions; one rank hits a CUDA OOM
while the others block in a "collective" (sleep, ignoring SIGTERM). The OOM rank records the
wall-clock time just before its line is written, for the teardown benchmark."""

import random
import signal
import subprocess
import sys
import time

if len(sys.argv) > 2 and sys.argv[1] == "--rank":
    rank, stamp = int(sys.argv[2]), sys.argv[3]
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if rank == 3:
        time.sleep(random.uniform(0.5, 1.5))
        # As a rank really reports it: the exception line that ends a traceback (a bare line of text
        # is only a hint and tears nothing down).
        line = (f"[rank{rank}]: Traceback (most recent call last):\n"
                f'[rank{rank}]:   File "/opt/train.py", line 42, in <module>\n'
                f"[rank{rank}]:     loss.backward()\n"
                f"[rank{rank}]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
                "GPU 3 has a total capacity of 79.15 GiB of which 1.02 GiB is free.\n")
        t = time.time()
        sys.stdout.write(line)
        sys.stdout.flush()
        with open(stamp, "w") as f:
            f.write(repr(t))
    while True:
        time.sleep(1)

stamp = sys.argv[1]
ranks = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), stamp], start_new_session=True)
         for r in range(4)]
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher waits for its ranks, like torchrun
for p in ranks:
    p.wait()
