"""The network, not the job (issue 29): urllib3's own account of a Hub request that never got an
answer ("Max retries exceeded ... Caused by ConnectTimeoutError", "Failed to establish a new
connection"), which huggingface_hub logs as a warning, not an exception line, was read as no
failure evidence. Logs copied from development-part excerpts of bench/corpus (thread per constant)."""

from supervisor.core.models import Category, ExitRecord
from supervisor.judge.diagnosis import diagnose_bytes
from tests.diagnosis.test_trust import HEALTHY, sample_block

# Toyhom/CLV#2 (environment_clv_tokenizer_connect_timeout)
CLV_2 = (
    b"Global seed set to 2022\n"
    b"'(MaxRetryError(\"HTTPSConnectionPool(host='huggingface.co', port=443): Max retries exceeded with url:"
    b" /uer/gpt2-chinese-cluecorpussmall/resolve/main/tokenizer_config.json (Caused by ConnectTimeoutError("
    b"<urllib3.connection.HTTPSConnection object at 0x000001A156B1A550>, 'Connection to huggingface.co timed out."
    b" (connect timeout=10)'))\"), '(Request ID: 8ba9b399-402e-463b-b2cf-cca80e22006a)')' thrown while requesting"
    b" HEAD https://huggingface.co/uer/gpt2-chinese-cluecorpussmall/resolve/main/tokenizer_config.json\n"
)
# huggingface/transformers#12575 (environment_transformers_cdn_lfs_name_not_known): the message
# wrapped over three lines, then a traceback the paste cut before its exception line.
TRANSFORMERS_12575 = (
    b"`HTTPSConnectionPool(host='cdn-lfs.huggingface.co', port=443): Max retries exceeded with url:"
    b" /bert-base-cased/d6992b8cd27d7a132eafce6a8210272329a371b1c762d453588795dd3\n"
    b"835593e (Caused by NewConnectionError('<urllib3.connection.HTTPSConnection object at 0x7ff9e60c6dd0>:"
    b" Failed to establish a new connection: [Errno -2] Name or service \n"
    b"not known'))\n"
    b"Traceback (most recent call last):\n"
    b'  File "/root/anaconda3/envs/bert/lib/python3.7/site-packages/urllib3/connection.py", line 170, in _new_conn\n'
    b"    (self._dns_host, self.port), self.timeout, **extra_kw\n"
)


def test_a_hub_request_that_got_no_answer_is_the_environment():
    for log in (CLV_2, TRANSFORMERS_12575):
        for exit in (None, ExitRecord(returncode=1)):
            d = diagnose_bytes(log, exit)
            assert d.category is Category.ENVIRONMENT, d.summary


def test_the_same_warning_in_a_printed_sample_does_not_act():
    assert diagnose_bytes(sample_block(CLV_2), ExitRecord(returncode=1)).category is Category.UNKNOWN


def test_training_that_went_on_after_the_warning_shows_it_was_survived():
    """huggingface_hub falls back to the cached file and the run trains: the warning did not end it."""
    d = diagnose_bytes(CLV_2 + HEALTHY, ExitRecord(returncode=1))
    assert d.category is Category.UNKNOWN, d.summary


def test_other_network_failures_in_their_own_words():
    """Beyond the corpus: requests' read timeout, a refused connection, git's failed DNS lookup."""
    for log in ((b"Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\n"
                b"requests.exceptions.ReadTimeout: HTTPSConnectionPool(host='huggingface.co', port=443): Read timed"
                b" out. (read timeout=10)\n"),
                b"fatal: unable to access 'https://github.com/x/y.git/': Could not resolve host: github.com\n"):
        d = diagnose_bytes(log, None)
        assert d.category is Category.ENVIRONMENT, d.summary


def test_a_later_crash_speaks_before_the_warning():
    """The hub fell back to its cache and the model loaded: a crash printed after that explains the end."""
    loaded = b"Loading checkpoint shards: 100%|##########| 2/2 [00:01<00:00,  1.20it/s]\n"
    d = diagnose_bytes(CLV_2 + loaded + b"Segmentation fault (core dumped)\n", None)
    assert d.category is Category.CRASH_OTHER, d.summary
