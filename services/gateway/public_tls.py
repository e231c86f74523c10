"""TLS of the gateway's public listeners (HTTP through uvicorn, the public gRPC API through grpcio).

The certificate defaults to the internal one (``--tls-cert/--tls-key``), so one set of files puts
TLS on every hop; ``--public-client-ca`` makes the public gRPC API demand client certificates too.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


@dataclass(frozen=True, slots=True)
class PublicTls:
    """File paths: the server's certificate chain and key, and the CA client certificates must chain
    to on the public gRPC API (None: no client certificate asked for)."""

    cert: str
    key: str
    client_ca: str | None = None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Raises OSError when a file cannot be read."""
        client_ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )

    def uvicorn_options(self) -> dict[str, Any]:
        """``uvicorn.Config`` keyword arguments serving HTTPS with this certificate."""
        return {"ssl_certfile": self.cert, "ssl_keyfile": self.key}


def add_public_tls_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("public TLS (HTTP API and public gRPC API)")
    group.add_argument("--public-tls-cert", default=None, help="PEM certificate chain (default: --tls-cert)")
    group.add_argument("--public-tls-key", default=None, help="PEM private key (default: --tls-key)")
    group.add_argument(
        "--public-client-ca",
        default=None,
        help="require client certificates signed by this PEM CA on the public gRPC API",
    )


def public_tls_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> PublicTls | None:
    """The public listeners' TLS, or None (plaintext); exits through ``parser.error`` on a half-given
    certificate, a client CA without a certificate, or a file that cannot be read."""
    cert = args.public_tls_cert or args.tls_cert
    key = args.public_tls_key or args.tls_key
    if not (cert or key):
        if args.public_client_ca:
            parser.error("--public-client-ca needs a server certificate (--public-tls-cert/--public-tls-key)")
        return None
    if not (cert and key):
        parser.error("public TLS needs both a certificate and its key (--public-tls-cert/--public-tls-key)")
    for path in (cert, key, args.public_client_ca):
        if path and not Path(path).is_file():
            parser.error(f"cannot read TLS file {path}")
    return PublicTls(cert, key, args.public_client_ca)
