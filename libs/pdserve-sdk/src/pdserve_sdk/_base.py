"""Settings and request assembly shared by ``Client`` and ``AsyncClient``."""

from __future__ import annotations

from typing import Any

from pdserve_sdk import _wire
from pdserve_sdk.config import ClientConfig, RetryPolicy, TlsConfig


class ClientBase:
    """A channel (from the subclass's ``grpc_module``: ``grpc`` or ``grpc.aio``) with its settings, plus
    per-client defaults for the model and the call timeout.

    Args:
        address: ``host:port`` of a gateway's public gRPC API; default ``$PDSERVE_ADDRESS``, else
            ``127.0.0.1:50051``.
        api_key: sent as ``authorization: Bearer <key>``; default ``$PDSERVE_API_KEY``, else none.
        model: model id for requests that name none ("" lets the server pick its default).
        timeout: default per-call deadline in seconds (``None``: no deadline); calls can override it.
        tls: ``TlsConfig`` (CA bundle, client cert/key for mTLS), ``True`` for TLS with the system's
            trust store, ``None``/``False`` for plaintext.
        retry: retry policy for UNAVAILABLE before the server accepted a call (default ``RetryPolicy()``).
    """

    grpc_module: Any

    def __init__(
        self,
        address: str | None = None,
        *,
        api_key: str | None = None,
        model: str = "",
        timeout: float | None = None,
        tls: TlsConfig | bool | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.config = ClientConfig.resolve(address, api_key, tls, retry)
        self.model = model
        self.timeout = timeout
        self._channel = self.config.open_channel(self.grpc_module)
        self._stubs = _wire.Stubs(self._channel)

    def _call_kwargs(self, timeout: float | None) -> dict[str, Any]:
        """``timeout`` (this call's, else the client's) and the metadata of one gRPC call."""
        return {"timeout": self.timeout if timeout is None else timeout, "metadata": self.config.metadata()}
