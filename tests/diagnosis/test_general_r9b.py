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
