"""Python client for the pdserve public gRPC API (``pdserve.v1.PdServe``), sync and asyncio.

from pdserve_sdk import Client

with Client("127.0.0.1:50051", api_key="...") as client:
    print(client.generate("The capital of France is", max_new_tokens=8, temperature=0).text)
"""

from pdserve_sdk.async_client import AsyncClient, AsyncStream
from pdserve_sdk.client import Client, Stream
from pdserve_sdk.config import RetryPolicy, TlsConfig
from pdserve_sdk.errors import (
    AuthenticationError,
    DeadlineExceededError,
    InvalidRequestError,
    NotFoundError,
    PdServeError,
    RateLimitError,
    ServiceUnavailableError,
)
from pdserve_sdk.requests import ChatKwargs, RequestKwargs, SamplingKwargs
from pdserve_sdk.results import (
    Choice,
    Delta,
    EmbedResult,
    GenerateResult,
    ModelCard,
    TokenLogprob,
    TopLogprob,
    Usage,
)

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "AuthenticationError",
    "ChatKwargs",
    "Choice",
    "Client",
    "DeadlineExceededError",
    "Delta",
    "EmbedResult",
    "GenerateResult",
    "InvalidRequestError",
    "ModelCard",
    "NotFoundError",
    "PdServeError",
    "RateLimitError",
    "RequestKwargs",
    "RetryPolicy",
    "SamplingKwargs",
    "ServiceUnavailableError",
    "Stream",
    "TlsConfig",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
]
