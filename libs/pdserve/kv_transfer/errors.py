"""Errors of the KV transfer library, and the NIXL binding errors they translate."""

from __future__ import annotations

from nixl import _bindings as nixl_bindings


class KVTransferError(RuntimeError):
    """A KV write or notification failed: unknown or dead peer, NIXL error, or a closed agent.

    The destination pages of a failed write hold undefined bytes; the caller frees them.
    """


class KVTransferTimeout(KVTransferError, TimeoutError):
    """A KV write or a notification did not complete within its timeout."""


class KVLayoutMismatch(KVTransferError, ValueError):
    """Two KV pools disagree on a layout fact (model, dtype, page size, ...): pages cannot be copied."""


# The binding raises one exception class per nixl_status_t; they share no base class.
NIXL_ERRORS: tuple[type[Exception], ...] = (
    nixl_bindings.nixlBackendError,
    nixl_bindings.nixlCancelledError,
    nixl_bindings.nixlInvalidParamError,
    nixl_bindings.nixlMismatchError,
    nixl_bindings.nixlNotAllowedError,
    nixl_bindings.nixlNotFoundError,
    nixl_bindings.nixlNotPostedError,
    nixl_bindings.nixlNotSupportedError,
    nixl_bindings.nixlRemoteDisconnectError,
    nixl_bindings.nixlRepostActiveError,
    nixl_bindings.nixlUnknownError,
)

PeerDisconnected = nixl_bindings.nixlRemoteDisconnectError
