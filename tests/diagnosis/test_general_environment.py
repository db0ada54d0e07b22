"""Network failures said in the libraries' own words (issue 29, generalising): the stdlib's lowercase
socket exceptions, requests' `raise_for_status` for any 5xx, transformers' wrapper of a hub HTTP error,
urllib3's timeout messages. Text from the libraries' raise statements (cited per case)."""

from supervisor.core.models import Category
from supervisor.judge.diagnosis import diagnose_bytes


def _tb(exc_line: bytes, frame: bytes = b'  File "/x/urllib3/util/connection.py", line 72, in create_connection\n') -> bytes:
    return b"Traceback (most recent call last):\n" + frame + b"    for res in socket.getaddrinfo(host, port):\n" + exc_line


def test_socket_gaierror_ending_a_traceback_is_environment():
    """CPython's socket.gaierror (Modules/socketmodule.c set_gaierror), Linux and Windows wording; the first
    of a chain cut after 'During handling' (bench r6 environment_bonito_*, nanoporetech/bonito)."""
    for exc in (b"socket.gaierror: [Errno -2] Name or service not known\n",
                b"socket.gaierror: [Errno -3] Temporary failure in name resolution\n",
                b"socket.gaierror: [Errno 11001] getaddrinfo failed\n"):
        for tail in (b"", b"\nDuring handling of the above exception, another exception occurred:\n\n"):
            d = diagnose_bytes(_tb(exc) + tail, None)
            assert d.category is Category.ENVIRONMENT, (exc, d.summary)


def test_any_5xx_said_by_raise_for_status_is_environment():
    """requests.models.Response.raise_for_status: '%s Server Error: %s for url: %s' (huggingface_hub
    re-raises it as HfHubHTTPError)."""
    line = (b"huggingface_hub.utils._errors.HfHubHTTPError: 500 Server Error: Internal Server Error for url:"
            b" https://huggingface.co/api/datasets/x/y\n")
    assert diagnose_bytes(_tb(line), None).category is Category.ENVIRONMENT
    assert diagnose_bytes(line, None).category is Category.ENVIRONMENT


def test_transformers_specific_connection_error_is_environment():
    """transformers/utils/hub.py: after RepositoryNotFound/Gated/EntryNotFound are handled, any other
    HTTPError becomes 'There was a specific connection error when trying to load {id}:\\n{err}'."""
    log = (b"OSError: There was a specific connection error when trying to load flax-community/roberta-base-thai:\n"
           b"429 Client Error: Too Many Requests for url: https://huggingface.co/x/resolve/main/config.json\n")
    assert diagnose_bytes(log, None).category is Category.ENVIRONMENT


def test_urllib3_timeout_messages_are_a_network_failure():
    """urllib3/connectionpool.py 'Read timed out. (read timeout=%s)' and connection.py
    'Connection to %s timed out. (connect timeout=%s)', inside whatever a caller logged them in."""
    for log in (
        (b"Warning: Failed to load dataset config 'default' from 'a/b'. Error: (ReadTimeoutError(\"HTTPSConnectionPool("
         b"host='huggingface.co', port=443): Read timed out. (read timeout=10)\"), '(Request ID: 38)')\n"),
        (b"error   requests.exceptions.ReadTimeout: (ReadTimeoutError(\"HTTPSConnectionPool(host='cdn-lfs-us-1.hugging"
         b"face.co', port=443): Read timed out. (read timeout=10)\"), '(Request ID: 96)')\n"),
    ):
        d = diagnose_bytes(log, None)
        assert d.category is Category.ENVIRONMENT, d.summary


def test_a_hub_not_found_or_gated_repo_is_still_not_environment():
    """huggingface_hub's RepositoryNotFoundError / GatedRepoError are the user's id or access."""
    for exc in (b"huggingface_hub.errors.RepositoryNotFoundError: 404 Client Error. Repository Not Found for url: x\n",
                b"huggingface_hub.errors.GatedRepoError: 403 Client Error. Cannot access gated repo for url: x\n"):
        assert diagnose_bytes(_tb(exc), None).category is not Category.ENVIRONMENT


def test_a_urllib3_read_timeout_wrapped_at_its_equals_sign():
    """bench r6 environment_cogvlm2_* (zai-org/CogVLM2): the terminal wrapped 'read timeout' / '=10)'."""
    log = (b"error   requests.exceptions.ReadTimeout: (ReadTimeoutError(\"HTTPSConnectionPool(host='cdn-lfs-us-1.hugging"
           b"face.co', port=443): Read timed out. (read timeout\n=10)\"), '(Request ID: 96de49cd)')\n")
    assert diagnose_bytes(log, None).category is Category.ENVIRONMENT


def test_connection_failures_in_urllib3_http_client_aiohttp_and_ssl_words():
    """urllib3's ProtocolError('Connection broken: ...'), requests' ChunkedEncodingError, http.client's
    RemoteDisconnected('Remote end closed connection without response'), aiohttp's ClientConnectorError
    ('Cannot connect to host ...') / ServerDisconnectedError, ssl's CERTIFICATE_VERIFY_FAILED."""
    for exc in ((b"requests.exceptions.ChunkedEncodingError: ('Connection broken: IncompleteRead(0 bytes read)',"
                b" IncompleteRead(0 bytes read))\n"),
                b"http.client.RemoteDisconnected: Remote end closed connection without response\n",
                (b"aiohttp.client_exceptions.ClientConnectorError: Cannot connect to host huggingface.co:443 ssl:default"
                b" [Connect call failed ('1.2.3.4', 443)]\n"),
                b"aiohttp.client_exceptions.ServerDisconnectedError: Server disconnected\n",
                (b"ssl.SSLCertVerificationError: [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get"
                b" local issuer certificate (_ssl.c:1007)\n")):
        d = diagnose_bytes(_tb(exc), None)
        assert d.category is Category.ENVIRONMENT, (exc, d.summary)


def test_a_bare_timeout_raised_inside_the_http_stack_is_environment():
    """CPython's socket raises TimeoutError('timed out') (socket.timeout before 3.10) from a connect that
    urllib3's util/connection.py create_connection makes; the first of the chain (bench r6
    environment_llamafactory_save_checkpoint_hub_timeout, hiyouga/LLaMA-Factory)."""
    for exc in (b"TimeoutError: timed out\n", b"socket.timeout: timed out\n"):
        log = (b"Traceback (most recent call last):\n"
               b'  File "/env/lib/python3.10/site-packages/urllib3/util/connection.py", line 73, in create_connection\n'
               b"    sock.connect(sa)\n" + exc)
        d = diagnose_bytes(log, None)
        assert d.category is Category.ENVIRONMENT, (exc, d.summary)


def test_a_timeout_raised_in_the_program_is_not():
    log = (b"Traceback (most recent call last):\n"
           b'  File "/work/train.py", line 73, in wait_for_batch\n'
           b"    raise TimeoutError('timed out')\n"
           b"TimeoutError: timed out\n")
    assert diagnose_bytes(log, None).category is not Category.ENVIRONMENT
