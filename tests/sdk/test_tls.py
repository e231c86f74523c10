"""TLS and mutual TLS: the SDK against a real gRPC server with certificates made by openssl."""

from __future__ import annotations

import subprocess
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pdserve_sdk import Client, NotFoundError, RetryPolicy, ServiceUnavailableError, TlsConfig

from pdserve.v1 import api_pb2_grpc
from tests.sdk.conftest import ScriptedPdServe

SERVER_NAME = "pdserve.test"


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


NEW_EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def _issue(directory: Path, name: str, extensions: str) -> None:
    """``name.key`` / ``name.pem``: an EC key and a certificate signed by ``ca`` with ``extensions``."""
    key, csr, pem, ext = (directory / f"{name}.{suffix}" for suffix in ("key", "csr", "pem", "ext"))
    ext.write_text(extensions)
    _openssl("req", *NEW_EC_KEY, "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
    ca = ("-CA", directory / "ca.pem", "-CAkey", directory / "ca.key", "-CAcreateserial")
    _openssl("x509", "-req", "-in", csr, *ca, "-days", "1", "-out", pem, "-extfile", ext)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A CA, a server certificate for ``pdserve.test`` and a client certificate, all signed by the CA."""
    directory = tmp_path_factory.mktemp("certs")
    ca_extensions = ("-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=keyCertSign")
    _openssl("req", "-x509", *NEW_EC_KEY, "-days", "1", "-keyout", directory / "ca.key",
             "-out", directory / "ca.pem", "-subj", "/CN=pdserve-test-ca", *ca_extensions)  # fmt: skip
    _issue(directory, "server", f"subjectAltName=DNS:{SERVER_NAME}\nextendedKeyUsage=serverAuth\n")
    _issue(directory, "client", "extendedKeyUsage=clientAuth\n")
    return directory


@pytest.fixture(scope="module")
def mtls_address(certs: Path) -> str:
    """A server demanding a client certificate from the CA, serving PdServe and grpc.health.v1."""
    credentials = grpc.ssl_server_credentials(
        [((certs / "server.key").read_bytes(), (certs / "server.pem").read_bytes())],
        root_certificates=(certs / "ca.pem").read_bytes(),
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
    tls = TlsConfig.from_files(certs / "ca.pem", certs / "client.pem", certs / "client.key", SERVER_NAME)
    with Client(mtls_address, tls=tls) as client:
        assert client.health() == "SERVING"
        with pytest.raises(NotFoundError):
            client.health("no.such.Service")
        assert client.generate("x", rid="plain:tls").text == "ab"


@pytest.mark.parametrize("what", ["no client certificate", "server name mismatch", "plaintext"])
def test_handshake_failures_are_unavailable(certs, mtls_address, what):
    tls = {
        "no client certificate": TlsConfig.from_files(certs / "ca.pem", server_name=SERVER_NAME),
        "server name mismatch": TlsConfig.from_files(
            certs / "ca.pem", certs / "client.pem", certs / "client.key"
        ),
        "plaintext": None,
    }[what]
    client = Client(mtls_address, tls=tls, retry=RetryPolicy(max_retries=0))
    with client, pytest.raises(ServiceUnavailableError):
        client.health(timeout=5)
