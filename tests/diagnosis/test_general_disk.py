"""A full disk in other writers' words (issue 29, generalising): TensorFlow maps ENOSPC/EDQUOT on a file
write to RESOURCE_EXHAUSTED (tensorflow/core/platform/errors.cc IOError), its saver writing a
`.tempstate<N>` bundle; Lua torch's THDiskFile.c says a short fwrite as 'write error: wrote %d blocks
instead of %d'."""

from supervisor.core.models import Category
from supervisor.judge.diagnosis import diagnose_bytes

TB = (b"Traceback (most recent call last):\n"
      b'  File "/usr/lib/python2.7/dist-packages/tensorflow/python/client/session.py", line 985, in _do_call\n'
      b"    raise type(e)(node_def, op, message)\n")


def test_tensorflow_resource_exhausted_on_a_checkpoint_file_is_disk_full():
    # bench r7 disk_full_tf_saver_save_slices_* (the saver's temp bundle) and TF's errno wording
    for exc in (b"ResourceExhaustedError: ./model/model-49.tempstate5787507096018461664\n",
                (b"tensorflow.python.framework.errors_impl.ResourceExhaustedError: /ckpt/model.ckpt-1.data-00000-of-00001"
                 b".tempstate123; No space left on device\n")):
        d = diagnose_bytes(TB + exc, None)
        assert d.category is Category.DISK_FULL, d.summary


def test_tensorflow_resource_exhausted_on_a_tensor_stays_gpu_oom():
    exc = (b"tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating tensor with"
           b" shape[256,1024] and type float on /job:localhost/replica:0/task:0/device:GPU:0\n")
    assert diagnose_bytes(TB + exc, None).category is Category.GPU_OOM


def test_lua_torch_short_write_is_a_failed_checkpoint_write():
    # bench r5 disk_full_neuralconvo_* (macournoyer/neuralconvo)
    log = (b"(Saving model ...)\n"
           b"/u/torch/install/bin/luajit: /u/torch/install/share/lua/5.1/torch/File.lua:201: write error: wrote 0 blocks"
           b" instead of 70610 at /u/torch/pkg/torch/lib/TH/THDiskFile.c:331\n"
           b"stack traceback:\n"
           b"\t[C]: in function 'write'\n"
           b"\t/u/torch/install/share/lua/5.1/torch/File.lua:201: in function 'writeObject'\n")
    assert diagnose_bytes(log, None).category is Category.DISK_FULL


def test_tensorflow_op_kernel_warning_on_a_tempstate_file_is_disk_full():
    """TF's op_kernel.cc logs the status it failed with ('Resource exhausted: <file>'); bench r7
    disk_full_kittiseg_* (MarvinTeichmann/KittiSeg), the log's only error line."""
    log = (b"2018-04-14 02:55:47.490099: W tensorflow/core/framework/op_kernel.cc:1158] Resource exhausted: /r/KittiSeg/"
           b"model.ckpt-2000.data-00000-of-00001.tempstate13881274976169662731\n")
    assert diagnose_bytes(log, None).category is Category.DISK_FULL


def test_tensorflow_queues_closing_after_it_do_not_hide_it():
    """TF's queue_base.cc warns as the session's queues are cancelled at shutdown; the traceback that
    follows is cut (bench r7 disk_full_kittiseg_*)."""
    log = (b"2018-04-14 02:55:47.490099: W tensorflow/core/framework/op_kernel.cc:1158] Resource exhausted: /r/"
           b"model.ckpt-2000.data-00000-of-00001.tempstate13881274976169662731\n"
           b"2018-04-14 02:55:47.491516: W tensorflow/core/kernels/queue_base.cc:294] _0_Queues/fifo_queue: Skipping"
           b" cancelled enqueue attempt with queue not closed\n"
           b"Traceback (most recent call last):\n"
           b'  File "train.py", line 127, in main\n'
           b"    train.do_training(hypes)\n")
    assert diagnose_bytes(log, None).category is Category.DISK_FULL


def test_other_spellings_of_enospc_and_edquot():
    """HDF5's 'errno = 28, error message = ...' (H5FDsec2.c), sqlite's SQLITE_FULL text, Rust's
    'os error 122', the EDQUOT name."""
    for exc in (b"OSError: Can't write data (file write failed: time = Mon, fd = 3, errno = 28, error message = 'x')\n",
                b"sqlite3.OperationalError: database or disk is full\n",
                (b"safetensors_rust.SafetensorError: Error while serializing: IoError(Os { code: 122, kind: Other,"
                b" message: \"os error 122\" })\n"),
                b"OSError: EDQUOT while writing /scratch/ckpt/model.bin\n"):
        d = diagnose_bytes(TB + exc, None)
        assert d.category is Category.DISK_FULL, (exc, d.summary)
