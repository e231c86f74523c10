"""Mutual TLS on the internal plane: one certificate, key and CA per process, from ``--tls-*`` flags.

Every internal gRPC server then demands a client certificate signed by the CA, and every internal
channel presents this process's certificate and verifies the server's against the CA (gRPC's own
``ssl_server_credentials`` / ``ssl_channel_credentials``). Without the flags the plane is plaintext.

A service calls ``configure(args)`` once, before it opens a server or a channel; servers take
``server_credentials()`` and channels come from ``internal_channel``. The identity is process-wide,
like the process's logging: peers deep inside the libraries (output streams, abort calls, the PD
handshake) open channels without having it handed down.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

FLAGS = ("tls_cert", "tls_key", "tls_ca")


@dataclass(frozen=True, slots=True)
class TlsIdentity:
    """PEM bytes of this process's certificate chain and key, and the CA its peers must chain to.

    Args:
        server_name: when set, the name every internal channel checks the server's certificate
            against instead of the target's host (one certificate for a fleet whose pods have
            changing IP addresses, e.g. ``pdserve.internal`` in its subjectAltName).
    """

    cert_chain: bytes
    private_key: bytes
    root_certificates: bytes
    server_name: str | None = None

    @classmethod
    def from_files(
        cls, cert: str | Path, key: str | Path, ca: str | Path, server_name: str | None = None
    ) -> TlsIdentity:
        """Read the three PEM files. Raises OSError when one cannot be read."""
        read = lambda path: Path(path).read_bytes()
        return cls(read(cert), read(key), read(ca), server_name or None)

    def server_credentials(self, client_ca: bytes | None = None) -> grpc.ServerCredentials:
        """A server with this certificate that requires a client certificate signed by ``client_ca``
        (default: the internal CA)."""
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=client_ca or self.root_certificates,
            require_client_auth=True,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.cert_chain)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


_identity: TlsIdentity | None = None


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    """``--tls-cert/--tls-key/--tls-ca`` (all three or none) and ``--tls-server-name``."""
    group = parser.add_argument_group("internal TLS (mutual: every internal server and client)")
    group.add_argument("--tls-cert", default=None, help="PEM certificate chain of this service")
    group.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    group.add_argument("--tls-ca", default=None, help="PEM CA that every peer's certificate must chain to")
    group.add_argument(
        "--tls-server-name",
        default=None,
        help="name peers' server certificates are checked against (default: the host dialled)",
    )


def identity_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TlsIdentity | None:
    """The identity the ``--tls-*`` flags name, or None without them; exits through ``parser.error``
    when only some are given or a file cannot be read."""
    given = [flag for flag in FLAGS if getattr(args, flag)]
    if not given:
        return None
    if len(given) != len(FLAGS):
        missing = ", ".join(f"--{flag.replace('_', '-')}" for flag in FLAGS if flag not in given)
        parser.error(f"TLS needs --tls-cert, --tls-key and --tls-ca together (missing {missing})")
    try:
        return TlsIdentity.from_files(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    except OSError as e:
        parser.error(f"cannot read a TLS file: {e}")


def configure(identity: TlsIdentity | None) -> None:
    """Set this process's internal identity (None: plaintext internal plane)."""
    global _identity
    _identity = identity


def identity() -> TlsIdentity | None:
    return _identity


def server_credentials() -> grpc.ServerCredentials | None:
    """Credentials of an internal server: mutual TLS once ``configure`` set an identity, else None."""
    return _identity.server_credentials() if _identity else None


def internal_channel(target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to an internal service: mutual TLS with this process's identity, or
    plaintext when none is configured."""
    if _identity is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    options = [*options, *_identity.channel_options()]
    return grpc.aio.secure_channel(target, _identity.channel_credentials(), options=options)
