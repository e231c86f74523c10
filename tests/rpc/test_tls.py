"""Internal mutual TLS (``pdserve.rpc.tls``) on a real grpc.aio server: who gets in, the name check,
the plaintext health-only port, and the flags."""

from __future__ import annotations

import argparse

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.rpc import tls
from pdserve.rpc.server import GrpcServer
from pdserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tests.certs import make_pki
from tests.stack import free_port_block


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), "node")


@pytest.fixture
def identity(pki):
    """This process's identity for the test, plaintext again afterwards."""
    identity = tls.TlsIdentity.from_files(pki.cert, pki.key, pki.ca)
    tls.configure(identity)
    yield identity
    tls.configure(None)


async def check(channel: grpc.aio.Channel) -> str:
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.aio.AioRpcError as e:
        return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def test_mutual_tls_admits_only_certified_clients_and_health_port_is_health_only(identity) -> None:
    health_port = free_port_block(1)
    server = GrpcServer(
        "127.0.0.1:0", [], credentials=tls.server_credentials(), health_address=f"127.0.0.1:{health_port}"
    )
    await server.start()
    await server.set_serving(True)
    try:
        async with tls.internal_channel(server.address) as channel:
            assert await check(channel) == "SERVING"
        async with grpc.aio.insecure_channel(server.address) as plaintext:
            assert await check(plaintext) == "UNAVAILABLE"
        no_cert = grpc.ssl_channel_credentials(identity.root_certificates)
        async with grpc.aio.secure_channel(server.address, no_cert) as anonymous:
            assert await check(anonymous) == "UNAVAILABLE"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as probe:
            assert await check(probe) == "SERVING"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await tokenizer_pb2_grpc.TokenizerStub(probe).Tokenize(
                    tokenizer_pb2.TokenizeRequest(text="x")
                )
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(0)


async def test_the_server_name_is_checked(pki) -> None:
    server = GrpcServer(
        "127.0.0.1:0",
        [],
        credentials=tls.TlsIdentity.from_files(pki.cert, pki.key, pki.ca).server_credentials(),
    )
    await server.start()
    await server.set_serving(True)
    try:
        for name, expected in (("localhost", "SERVING"), ("pdserve.internal", "UNAVAILABLE")):
            tls.configure(tls.TlsIdentity.from_files(pki.cert, pki.key, pki.ca, server_name=name))
            async with tls.internal_channel(server.address) as channel:
                assert await check(channel) == expected, name
    finally:
        tls.configure(None)
        await server.stop(0)


def test_flags_need_all_three_files(pki, capsys) -> None:
    parser = argparse.ArgumentParser()
    tls.add_tls_args(parser)
    assert tls.identity_from_args(parser, parser.parse_args([])) is None
    full = parser.parse_args(
        ["--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--tls-ca", str(pki.ca)]
    )
    assert tls.identity_from_args(parser, full).cert_chain == pki.cert.read_bytes()
    for argv, message in (
        (["--tls-cert", str(pki.cert)], "missing --tls-key, --tls-ca"),
        (
            ["--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--tls-ca", "/nonexistent.pem"],
            "cannot read",
        ),
    ):
        with pytest.raises(SystemExit):
            tls.identity_from_args(parser, parser.parse_args(argv))
        assert message in capsys.readouterr().err
