"""Property test of the public gRPC API's validation (hypothesis), without schedulers.

Sampling parameters are drawn across their whole wire types (int32, int64, float32 with NaN and
inf, long lists and maps): a request is refused with INVALID_ARGUMENT naming a field that is out of
bounds exactly when the test's own reading of ``pdserve.sampling.bounds`` (and of the HF vocabulary
and context) says one is; otherwise it passes validation and ends UNAVAILABLE, as every valid request
does on ``local_gateway``, which has no scheduler. Never INTERNAL or UNKNOWN.
"""

from __future__ import annotations

import math

import grpc
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.sampling import bounds
from pdserve.v1 import api_pb2, api_pb2_grpc, common_pb2
from tests.gateway.conftest import API_KEY
from tests.reference import context_length, vocab_size

PROMPT = [1, 2, 3]
DEFAULT_MAX_TOKENS = 4096  # the gateway's --default-max-tokens
INT32 = st.integers(-(2**31), 2**31 - 1)
FLOAT32 = st.floats(width=32)  # NaN and +-inf included


def near(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Integers around a range's edges, inside and outside, plus anywhere in int32."""
    return st.one_of(st.integers(lo - 2, lo + 2), st.integers(hi - 2, hi + 2), INT32)


def fields() -> st.SearchStrategy[dict]:
    token = st.one_of(st.integers(0, 50_000), st.integers(-3, -1), INT32)
    optional = {
        "temperature": st.one_of(FLOAT32, st.floats(0, 2, width=32)),
        "top_p": st.one_of(FLOAT32, st.floats(0, 1, width=32)),
        "top_k": st.deferred(lambda: near(-1, vocab_size())),
        "min_p": FLOAT32,
        "repetition_penalty": FLOAT32,
        "frequency_penalty": FLOAT32,
        "presence_penalty": FLOAT32,
        "max_new_tokens": st.deferred(lambda: near(1, context_length() - len(PROMPT))),
        "min_new_tokens": st.one_of(st.integers(-2, 8), INT32),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "n": st.integers(-2, bounds.MAX_N + 2),
        "top_logprobs_num": st.integers(-2, bounds.MAX_TOP_LOGPROBS + 2),
        "return_logprob": st.booleans(),
        "stop_token_ids": st.one_of(
            st.lists(token, max_size=4), st.lists(st.just(1), min_size=1020, max_size=1030)
        ),
        "stop": st.one_of(
            st.lists(st.text(min_size=0, max_size=300), max_size=4),
            st.lists(st.text(min_size=1, max_size=40), min_size=60, max_size=70),
        ),
        "logit_bias": st.one_of(
            st.dictionaries(token, FLOAT32, max_size=4),
            st.dictionaries(st.integers(0, 2000), st.just(1.0), min_size=1020, max_size=1030),
        ),
    }
    return st.fixed_dictionaries({}, optional=optional)


def float32(x: float) -> float:
    return float(np.float32(x))


def out_of_bounds(f: dict) -> set[str]:
    """The fields of ``f`` the bounds refuse (names as the error message writes them)."""
    v, bad = vocab_size(), set()

    def real(name: str, lo: float, hi: float, open_lo: bool = False) -> None:
        if name in f:
            x = float32(f[name])
            if not (math.isfinite(x) and lo <= x <= hi) or (open_lo and x <= lo):
                bad.add(name)

    real("temperature", 0.0, bounds.FLOAT32_MAX)
    real("top_p", 0.0, 1.0, open_lo=True)
    real("min_p", 0.0, 1.0)
    real("repetition_penalty", 0.0, bounds.FLOAT32_MAX, open_lo=True)
    real("frequency_penalty", -2.0, 2.0)
    real("presence_penalty", -2.0, 2.0)
    if not -1 <= f.get("top_k", 0) <= v:
        bad.add("top_k")
    max_new = f.get("max_new_tokens")
    if max_new is not None and max_new < 1:
        bad.add("max_new_tokens")
    elif max_new is not None and len(PROMPT) + max_new > context_length():
        bad.add("context length")
    min_new = f.get("min_new_tokens", 0)
    limit = max_new if max_new is not None else min(context_length() - len(PROMPT), DEFAULT_MAX_TOKENS)
    if min_new < 0 or (max_new is None or max_new >= 1) and min_new > limit:
        bad.add("min_new_tokens")
    if not 1 <= f.get("n", 1) <= bounds.MAX_N:
        bad.add("n")
    top = f.get("top_logprobs_num", 0)
    if not 0 <= top <= bounds.MAX_TOP_LOGPROBS or (top and not f.get("return_logprob")):
        bad.add("top_logprobs_num")
    ids = f.get("stop_token_ids", [])
    if len(ids) > bounds.MAX_STOP_TOKEN_IDS or any(not 0 <= i < v for i in ids):
        bad.add("stop_token_ids")
    stop = f.get("stop", [])
    if (
        len(stop) > bounds.MAX_STOP_STRINGS
        or any(not s or len(s) > bounds.MAX_STOP_STRING_CHARS for s in stop)
        or sum(map(len, stop)) > bounds.MAX_STOP_TOTAL_CHARS
        or any(_not_utf8(s) for s in stop)
    ):
        bad.add("stop")
    bias = f.get("logit_bias", {})
    values_ok = all(math.isfinite(float32(x)) and abs(float32(x)) <= 100 for x in bias.values())
    if len(bias) > bounds.MAX_LOGIT_BIAS_ENTRIES or any(not 0 <= i < v for i in bias) or not values_ok:
        bad.add("logit_bias")
    return bad


def _not_utf8(s: str) -> bool:
    try:
        s.encode()
    except UnicodeEncodeError:
        return True
    return False


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(f=fields())
async def test_refused_exactly_when_a_field_is_out_of_bounds(local_gateway, f: dict) -> None:
    if any(_not_utf8(s) for s in f.get("stop", [])):
        return  # protobuf cannot even carry it: the client refuses to serialize
    request = api_pb2.GenerateRequest(
        input_ids=api_pb2.TokenIds(ids=PROMPT), sampling_params=common_pb2.SamplingParams(**f)
    )
    async with grpc.aio.insecure_channel(local_gateway.grpc_address) as channel:
        stub = api_pb2_grpc.PdServeStub(channel)
        try:
            async for _ in stub.Generate(request, metadata=(("authorization", f"Bearer {API_KEY}"),)):
                pass
            code, details = grpc.StatusCode.OK, ""
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details()
    bad = out_of_bounds(f)
    if bad:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (bad, code, details)
        assert any(name in details for name in bad), (bad, details)
    else:
        assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
