"""Fixtures of the SDK tests: a stack launched with an API key, and a scripted in-process PdServe server."""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from concurrent import futures

import grpc
import pytest

from pdserve.v1 import api_pb2, api_pb2_grpc, common_pb2
from tests.conftest import COMMON
from tests.stack import Stack, launch_stack

API_KEY = "k"


@pytest.fixture(scope="package")
def auth_stack() -> Stack:
    """A colocated fp32 stack whose gateway requires ``authorization: Bearer k`` (stopped after tests/sdk)."""
    stack = launch_stack(*COMMON, "--colocated", "--api-key", API_KEY, log_name="sdk-auth")
    yield stack
    stack.stop()


class ScriptedPdServe(api_pb2_grpc.PdServeServicer):
    """``Generate`` follows the request's rid, so tests can make any status happen on demand:

    - ``"fail:<CODE>"``: abort with ``grpc.StatusCode.<CODE>`` and the message ``"scripted <CODE>"``;
    - ``"flaky:<k>"``: UNAVAILABLE on the first k attempts, then two pieces ``"a"``, ``"b"``;
    - ``"midstream"``: one piece, then UNAVAILABLE (the call was accepted: must not be retried);
    - ``"endless"``: a piece every 10 ms until the client goes away;
    - anything else: the pieces ``"a"``, ``"b"``.

    A further ``":<tag>"`` suffix only makes the rid (and so its attempt count) unique.

    ``attempts`` counts calls per rid; ``metadata`` keeps each call's invocation metadata; ``ended[rid]``
    is set when the server sees the call end (finished, failed or cancelled by the client).
    """

    def __init__(self) -> None:
        self.attempts: Counter[str] = Counter()
        self.metadata: list[dict[str, str]] = []
        self.ended: defaultdict[str, threading.Event] = defaultdict(threading.Event)
        self._lock = threading.Lock()

    def Generate(self, request, context):
        with self._lock:
            self.attempts[request.rid] += 1
            attempt = self.attempts[request.rid]
            self.metadata.append(dict(context.invocation_metadata()))
        context.add_callback(self.ended[request.rid].set)
        kind, arg, *_ = [*request.rid.split(":"), ""]
        while kind == "endless" and not self.ended[request.rid].wait(0.01):
            yield api_pb2.GenerateResponse(rid=request.rid, text="x", token_ids=[0])
        if kind == "fail":
            context.abort(grpc.StatusCode[arg], f"scripted {arg}")
        if kind == "flaky" and attempt <= int(arg):
            context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
        yield api_pb2.GenerateResponse(rid=request.rid, text="a", token_ids=[1])
        if kind == "midstream":
            context.abort(grpc.StatusCode.UNAVAILABLE, "backend lost")
        yield api_pb2.GenerateResponse(
            rid=request.rid,
            text="b",
            token_ids=[2],
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=api_pb2.Usage(prompt_tokens=3, completion_tokens=2),
        )

    def ListModels(self, request, context):
        return api_pb2.ListModelsResponse(models=[api_pb2.ModelCard(id="scripted", context_length=7)])


@pytest.fixture(scope="session")
def scripted_server() -> tuple[str, ScriptedPdServe]:
    """``(address, servicer)`` of a real gRPC server running ``ScriptedPdServe`` on a free port."""
    servicer = ScriptedPdServe()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    api_pb2_grpc.add_PdServeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)
