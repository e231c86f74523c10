"""Connection settings: target, API key, TLS and the retry policy, turned into channel arguments."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
ADDRESS_ENV = "PDSERVE_ADDRESS"
API_KEY_ENV = "PDSERVE_API_KEY"


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries of calls that failed with UNAVAILABLE before the server accepted them.

    Carried out by gRPC itself (``retryPolicy`` of the channel's service config, gRFC A6): an
    attempt is retried only until the call is committed, i.e. before the first response (headers
    or message) arrives, so a generation that has started is never sent twice. The n-th retry
    waits ``min(initial_backoff * backoff_multiplier**(n-1), max_backoff)`` seconds with gRPC's
    jitter, all within the call's ``timeout``.

    Args:
        max_retries: retries after the first attempt, 0..4 (gRPC caps attempts at 5).
        initial_backoff: seconds before the first retry (> 0).
        max_backoff: cap on one wait, seconds (>= initial_backoff).
        backoff_multiplier: growth of the wait per retry (>= 1).

    Raises:
        ValueError: on values outside those ranges.
    """

    max_retries: int = 3
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    backoff_multiplier: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.max_retries <= 4:
            raise ValueError(f"max_retries must be in 0..4 (gRPC allows 5 attempts), got {self.max_retries}")
        if not 0 < self.initial_backoff <= self.max_backoff:
            raise ValueError(
                f"need 0 < initial_backoff <= max_backoff, got {self.initial_backoff}, {self.max_backoff}"
            )
        if self.backoff_multiplier < 1:
            raise ValueError(f"backoff_multiplier must be >= 1, got {self.backoff_multiplier}")

    def service_config(self) -> str:
        """The ``grpc.service_config`` JSON applying this policy to every method of the channel."""
        method_config: dict[str, Any] = {"name": [{}]}
        if self.max_retries:
            method_config["retryPolicy"] = {
                "maxAttempts": self.max_retries + 1,
                "initialBackoff": f"{self.initial_backoff:.9f}s",
                "maxBackoff": f"{self.max_backoff:.9f}s",
                "backoffMultiplier": self.backoff_multiplier,
                "retryableStatusCodes": ["UNAVAILABLE"],
            }
        return json.dumps({"methodConfig": [method_config]})


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """TLS for the channel: PEM bytes; no ``root_certificates`` means the system's trust store.

    Args:
        root_certificates: CA bundle the server's certificate must chain to.
        certificate_chain, private_key: the client's certificate and key, for mutual TLS (both or neither).
        server_name: name to verify the server's certificate against instead of the target's host.

    Raises:
        ValueError: when only one of ``certificate_chain`` and ``private_key`` is given.
    """

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("mutual TLS needs both certificate_chain and private_key")

    @classmethod
    def from_files(
        cls,
        ca: str | Path | None = None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        server_name: str | None = None,
    ) -> TlsConfig:
        """Read the PEM files ``ca`` (root certificates), ``cert`` and ``key`` (client identity)."""
        read = lambda path: None if path is None else Path(path).read_bytes()
        return cls(read(ca), read(cert), read(key), server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Everything needed to open a channel and authenticate calls on it."""

    target: str
    api_key: str | None
    tls: TlsConfig | None
    retry: RetryPolicy

    @classmethod
    def resolve(
        cls,
        address: str | None,
        api_key: str | None,
        tls: TlsConfig | bool | None,
        retry: RetryPolicy | None,
    ) -> ClientConfig:
        """Arguments first, then ``$PDSERVE_ADDRESS`` / ``$PDSERVE_API_KEY``, then defaults.

        ``tls=True`` means TLS with the system's trust store; ``None``/``False`` a plaintext channel.
        """
        target = address or os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        tls_config = TlsConfig() if tls is True else (tls or None)
        return cls(target, key, tls_config, retry or RetryPolicy())

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: ``authorization: Bearer <key>`` when a key is set."""
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def options(self) -> list[tuple[str, Any]]:
        options: list[tuple[str, Any]] = [
            ("grpc.enable_retries", 1),
            ("grpc.service_config", self.retry.service_config()),
            ("grpc.primary_user_agent", f"pdserve-sdk/{version('pdserve-sdk')}"),
        ]
        if self.tls and self.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return options

    def open_channel(self, grpc_module: Any) -> Any:
        """A channel from ``grpc_module`` (``grpc`` or ``grpc.aio``): secure when TLS is set."""
        if self.tls is None:
            return grpc_module.insecure_channel(self.target, options=self.options())
        return grpc_module.secure_channel(self.target, self.tls.credentials(), options=self.options())
