"""``pdserve launch --tls-cert/--tls-key/--tls-ca``: TLS on every hop of a PD stack (1 prefill + 1 decode).

Internal: gateway -> tokenizer / decode, decode -> prefill (PD handshake), decode -> detokenizer,
detokenizer -> gateway (its internal server), all mutual TLS with one certificate; the greedy answers
below could only come back if every hop worked. Public: HTTPS for the OpenAI API (the official client
given the CA), TLS with a client certificate on the gRPC API (``--public-client-ca``, the SDK). A
client without a valid certificate (none, plaintext, or one from another CA) is refused on every
internal port, and no process's command line carries the API key. Certificates are made here.
"""

from __future__ import annotations

import ssl

import grpc
import httpx
import openai
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve_sdk import Client, RetryPolicy, ServiceUnavailableError, TlsConfig

from tests.certs import Pki, make_pki
from tests.reference import chat_ids, hf_greedy, hf_tokenizer
from tests.stack import SERVED_MODEL, Stack, launch_stack

API_KEY = "sk-tls-test-key"
PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), "pdserve")


@pytest.fixture(scope="module")
def rogue(tmp_path_factory) -> Pki:
    """A certificate for the same names from a CA the stack does not trust."""
    return make_pki(tmp_path_factory.mktemp("rogue"), "rogue")


@pytest.fixture(scope="module")
def tls_stack(pki: Pki) -> Stack:
    files = ("--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--tls-ca", str(pki.ca))
    stack = launch_stack(
        "--num-prefill", "1", "--num-decode", "1", "--dtype", "float32", "--max-total-tokens", "4096",
        *files, "--public-client-ca", str(pki.ca),
        log_name="tls", env={"PDSERVE_API_KEY": API_KEY}, tls_ca=str(pki.ca),
    )  # fmt: skip
    yield stack
    stack.stop()


@pytest.fixture
def stack(tls_stack: Stack) -> Stack:
    yield tls_stack
    tls_stack.check_kv_conservation()


def internal_addresses(stack: Stack) -> dict[str, str]:
    base = stack.internal_port_base
    ports = {"tokenizer": 1, "detokenizer": 2, "gateway-internal": 3, "prefill": 10, "decode": 20}
    return {name: f"127.0.0.1:{base + offset}" for name, offset in ports.items()}


def test_https_chat_with_the_openai_client(stack: Stack, pki: Pki) -> None:
    client = openai.OpenAI(
        base_url=f"{stack.base_url}/v1",
        api_key=API_KEY,
        max_retries=0,
        http_client=httpx.Client(verify=ssl.create_default_context(cafile=pki.ca), timeout=300),
    )
    answer = client.chat.completions.create(
        model=SERVED_MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    expected = hf_greedy(chat_ids([{"role": "user", "content": QUESTION}]), MAX_TOKENS)
    assert answer.choices[0].message.content == hf_tokenizer().decode(expected, skip_special_tokens=True)
    with pytest.raises(httpx.HTTPError):  # plaintext HTTP on the HTTPS port
        httpx.get(f"http://127.0.0.1:{stack.port}/health", timeout=5)
    with pytest.raises(httpx.ConnectError):  # a certificate the client does not trust
        httpx.get(f"{stack.base_url}/health", timeout=5)


def test_sdk_over_mutual_tls(stack: Stack, pki: Pki) -> None:
    tls = TlsConfig.from_files(pki.ca, pki.cert, pki.key)
    with Client(stack.grpc_address, api_key=API_KEY, tls=tls) as client:
        result = client.generate(PROMPT, temperature=0, max_new_tokens=MAX_TOKENS)
    assert result.token_ids == hf_greedy(hf_tokenizer()(PROMPT)["input_ids"], MAX_TOKENS)
    no_client_cert = TlsConfig.from_files(pki.ca)
    refused = Client(stack.grpc_address, api_key=API_KEY, tls=no_client_cert, retry=RetryPolicy(0))
    with refused, pytest.raises(ServiceUnavailableError):
        refused.generate(PROMPT, max_new_tokens=1, timeout=10)


def _health(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode | str:
    """``grpc.health.v1`` Check over ``credentials`` (None: plaintext): the status name, or the error code."""
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.RpcError as e:
            return e.code()
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_internal_ports_refuse_clients_without_a_valid_certificate(tls_stack: Stack, pki: Pki, rogue: Pki):
    ca = pki.ca.read_bytes()
    clients = {
        "plaintext": None,
        "no client certificate": grpc.ssl_channel_credentials(ca),
        "certificate of another CA": grpc.ssl_channel_credentials(
            ca, rogue.key.read_bytes(), rogue.cert.read_bytes()
        ),
    }
    valid = grpc.ssl_channel_credentials(ca, pki.key.read_bytes(), pki.cert.read_bytes())
    for name, address in internal_addresses(tls_stack).items():
        assert _health(address, valid) == "SERVING", name
        for what, credentials in clients.items():
            assert _health(address, credentials) == grpc.StatusCode.UNAVAILABLE, (name, what)


def test_no_command_line_carries_the_api_key(tls_stack: Stack, pki: Pki) -> None:
    launcher = psutil.Process(tls_stack.proc.pid)
    processes = [launcher, *launcher.children(recursive=True)]
    assert len(processes) >= 6  # the launcher and its five services
    secrets = (API_KEY, pki.key.read_text().splitlines()[1])
    for proc in processes:
        command = " ".join(proc.cmdline())
        assert not any(secret in command for secret in secrets), command


def test_every_listener_is_on_loopback_and_the_public_ones_are_the_gateways(tls_stack: Stack) -> None:
    """Each service listens on 127.0.0.1 only, NIXL/UCX included (``UCX_NET_DEVICES=lo`` from the
    internal host; unrestricted, UCX also listened on every other interface)."""
    launcher = psutil.Process(tls_stack.proc.pid)
    public = {tls_stack.port, tls_stack.grpc_port}
    for proc in launcher.children(recursive=True):
        listeners = [c.laddr for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        role = proc.cmdline()[proc.cmdline().index("pdserve.cli") + 1]
        assert listeners, role
        assert {a.ip.removeprefix("::ffff:") for a in listeners} == {"127.0.0.1"}, (role, listeners)
        assert role == "gateway" or not public & {a.port for a in listeners}, role
    assert {c.laddr.port for c in launcher.net_connections("tcp") if c.status == psutil.CONN_LISTEN} == set()
