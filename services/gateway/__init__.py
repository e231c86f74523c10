"""The gateway: OpenAI-compatible HTTP API and the public gRPC API in front of the pdserve services.

Its rooms, in the order a request passes them:

- ``openai/``: the HTTP API: request and response models (OpenAI's, and SGLang-native
  ``/generate``, ``/tokenize``, ``/detokenize``), one serving module per endpoint, SSE chunks, and
  the chat output's text work (structured outputs, tool-call and reasoning parsers).
- ``requests/``: the request path of this replica: admission, fan-out into sub-requests, send,
  abort, drain (``manager``), and each request's state and output queue (``state``).
- ``routing/``: which workers a sub-request goes to: worker pools, policies (cache-aware over an
  approximate prefix tree), the router, health and load monitoring, DNS discovery.
- ``transport/``: the gRPC edges: the public ``PdServe`` servicer, the ``GatewayOutput`` servicer
  the detokenizers stream into, the clients of the backend services, and the protobuf conversions
  (the only gateway modules that import ``pdserve.v1``).

At the top: the entry point (``main``: flags and servers; ``processes``: ``--workers N``), the
FastAPI app (``app``, ``middleware``, ``auth``, ``health``, ``metrics``), the errors, the public TLS,
and the transport-free request and output objects every room shares (``io_struct``).
"""
