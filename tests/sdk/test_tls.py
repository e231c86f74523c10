"""TLS and mutual TLS: the SDK against a real gRPC server with certificates made by ``tests.certs``."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pdserve_sdk import Client, NotFoundError, RetryPolicy, ServiceUnavailableError, TlsConfig

from pdserve.v1 import api_pb2_grpc
from tests.certs import Pki, make_pki
from tests.sdk.conftest import ScriptedPdServe

SERVER_NAME = "pdserve.test"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Pki:
    """A CA and a certificate it signed for ``pdserve.test`` only (not the address dialled), used by
    the server and by the client alike."""
    return make_pki(tmp_path_factory.mktemp("certs"), "pdserve", dns_names=(SERVER_NAME,), ips=())


@pytest.fixture(scope="module")
def mtls_address(certs: Pki) -> str:
    """A server demanding a client certificate from the CA, serving PdServe and grpc.health.v1."""
    credentials = grpc.ssl_server_credentials(
        [(certs.key.read_bytes(), certs.cert.read_bytes())],
        root_certificates=certs.ca.read_bytes(),
        require_client_auth=True,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    api_pb2_grpc.add_PdServeServicer_to_server(ScriptedPdServe(), server)
    health_servicer = health.HealthServicer()
    health_servicer.set("pdserve.v1.PdServe", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_mutual_tls(certs, mtls_address):
    tls = TlsConfig.from_files(certs.ca, certs.cert, certs.key, SERVER_NAME)
    with Client(mtls_address, tls=tls) as client:
        assert client.health() == "SERVING"
        with pytest.raises(NotFoundError):
            client.health("no.such.Service")
        assert client.generate("x", rid="plain:tls").text == "ab"


@pytest.mark.parametrize("what", ["no client certificate", "server name mismatch", "plaintext"])
def test_handshake_failures_are_unavailable(certs, mtls_address, what):
    tls = {
        "no client certificate": TlsConfig.from_files(certs.ca, server_name=SERVER_NAME),
        "server name mismatch": TlsConfig.from_files(certs.ca, certs.cert, certs.key),
        "plaintext": None,
    }[what]
    client = Client(mtls_address, tls=tls, retry=RetryPolicy(max_retries=0))
    with client, pytest.raises(ServiceUnavailableError):
        client.health(timeout=5)
