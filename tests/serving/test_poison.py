"""One bad request fails only itself (issue 19): 8 greedy requests decode on the real model while
requests with every kind of out-of-bounds parameter arrive, together with them or mid-decode, in
colocated and PD mode. Each bad request gets a 400 (INVALID_ARGUMENT on gRPC, also straight to the
decode-scheduler's internal port) naming its field, and the 8 finish with HF's greedy tokens.

The bounds come from ``pdserve.sampling.bounds``; the vocabulary and context size from the HF
tokenizer and config, not from the server.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections import Counter

import grpc
import httpx
import pytest

from pdserve.sampling import bounds
from pdserve.v1 import api_pb2, api_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.reference import chat_ids, context_length, hf_greedy, hf_tokenizer, vocab_size
from tests.stack import SERVED_MODEL, Stack

NEW_TOKENS = 24
QUESTIONS = [
    "What is the capital of France?",
    "Name three animals that live in the ocean.",
    "Explain in one sentence what a computer does.",
    "Write a haiku about autumn leaves.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What is two plus two?",
    "Describe a city at night.",
]
HI = [{"role": "user", "content": "Hi"}]
INT32, INT64 = 2**31, 2**63


@functools.cache
def greedy_cases() -> list[tuple[list[int], list[int]]]:
    """(prompt ids, HF greedy output) of the 8; EOS masked so every one decodes ``NEW_TOKENS`` tokens."""
    prompts = [chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    return [(p, hf_greedy(p, NEW_TOKENS, min_new_tokens=NEW_TOKENS)) for p in prompts]


def chat(**fields) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": SERVED_MODEL, "messages": HI, "max_tokens": 4, **fields}


def generate(prompt=None, **sampling) -> tuple[str, dict]:
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 4, **sampling}}
    return "/generate", body if prompt is None else {**body, "text": prompt}


def stops_over_the_total() -> list[str]:
    per = bounds.MAX_STOP_STRING_CHARS
    return ["x" * per] * (bounds.MAX_STOP_TOTAL_CHARS // per + 1)


# id -> (path, body, the field the 400 names); callables are evaluated when the test runs
BAD_HTTP = {
    "top_k-above-vocab": lambda: (*chat(top_k=vocab_size() + 1), "top_k"),
    "top_k-huge": lambda: (*chat(top_k=2**40), "top_k"),
    "completions-top_k": lambda: (
        "/v1/completions",
        {"model": SERVED_MODEL, "prompt": "Hi", "max_tokens": 4, "top_k": vocab_size() + 1},
        "top_k",
    ),
    "generate-top_k": lambda: (*generate(top_k=vocab_size() + 1), "sampling_params.top_k"),
    "detokenize-int32": lambda: ("/detokenize", {"tokens": [1, INT32]}, "tokens.1"),
    "detokenize-vocab": lambda: ("/detokenize", {"tokens": [vocab_size()]}, "tokens"),
    "seed-2^63": lambda: (*chat(seed=INT64), "seed"),
    "generate-seed-below-int64": lambda: (*generate(seed=-INT64 - 1), "sampling_params.seed"),
    "stop_token_ids-2^32": lambda: (*chat(stop_token_ids=[2**32]), "stop_token_ids.0"),
    "stop_token_ids-vocab": lambda: (
        *generate(stop_token_ids=[vocab_size()]),
        "sampling_params.stop_token_ids",
    ),
    "stop_token_ids-count": lambda: (
        *chat(stop_token_ids=[1] * (bounds.MAX_STOP_TOKEN_IDS + 1)),
        "stop_token_ids",
    ),
    "stop-100k-strings": lambda: (*generate(stop=[f"s{i}" for i in range(100_000)]), "sampling_params.stop"),
    "stop-long-string": lambda: (*chat(stop="x" * (bounds.MAX_STOP_STRING_CHARS + 1)), "stop"),
    "stop-total": lambda: (*chat(stop=stops_over_the_total()), "stop"),
    "logit_bias-vocab": lambda: (*chat(logit_bias={str(vocab_size()): 1}), "logit_bias"),
    "logit_bias-int32": lambda: (*chat(logit_bias={str(INT32): 1}), f"logit_bias.{INT32}"),
    "logit_bias-count": lambda: (
        *chat(logit_bias={str(i): 1 for i in range(bounds.MAX_LOGIT_BIAS_ENTRIES + 1)}),
        "logit_bias",
    ),
    "n-over-128": lambda: (*chat(n=bounds.MAX_N + 1), "n"),
    "batch-times-n-over-pending": lambda: (
        *generate(["Hi"] * 9, n=bounds.MAX_N),  # 1,152 sub-requests; --max-pending-requests is 1,024
        "sampling_params.n",
    ),
    "max_tokens-int32": lambda: (*chat(max_tokens=INT32), "max_tokens"),
    "max_tokens-over-context": lambda: (*chat(max_tokens=context_length()), "messages"),
    "min_tokens-int32": lambda: (*chat(max_tokens=None, min_tokens=INT32), "min_tokens"),
    "min_tokens-over-context": lambda: (*chat(max_tokens=None, min_tokens=context_length()), "min_tokens"),
    "repetition_penalty-over-float32": lambda: (*chat(repetition_penalty=1e39), "repetition_penalty"),
    "continue-a-user-message": lambda: (
        *chat(add_generation_prompt=False, continue_final_message=True),
        "continue_final_message",
    ),
    "completions-id-outside-vocab": lambda: (
        "/v1/completions",
        {"model": SERVED_MODEL, "prompt": [vocab_size()], "max_tokens": 4},
        "prompt",
    ),
}


def bad_grpc() -> dict[str, tuple[api_pb2.GenerateRequest, str]]:
    """Public gRPC API: request -> a field its INVALID_ARGUMENT names."""
    sp = common_pb2.SamplingParams
    return {
        "grpc-top_k": (
            api_pb2.GenerateRequest(text="Hi", sampling_params=sp(top_k=vocab_size() + 1)),
            "top_k",
        ),
        "grpc-stop_token_ids": (
            api_pb2.GenerateRequest(text="Hi", sampling_params=sp(stop_token_ids=[vocab_size()])),
            "stop_token_ids",
        ),
        "grpc-logit_bias": (
            api_pb2.GenerateRequest(text="Hi", sampling_params=sp(logit_bias={vocab_size() + 7: 1.0})),
            "logit_bias",
        ),
        "grpc-input-id": (api_pb2.GenerateRequest(input_ids=api_pb2.TokenIds(ids=[-5])), "token id -5"),
    }


def bad_internal() -> dict[str, tuple[common_pb2.SamplingParams, str]]:
    """Straight to the decode-scheduler's internal Generate (past the gateway): params -> field."""
    sp = common_pb2.SamplingParams
    return {
        "internal-top_k": (sp(top_k=vocab_size() + 1, max_new_tokens=4), "top_k"),
        "internal-stop_token_ids": (
            sp(stop_token_ids=[vocab_size()], max_new_tokens=4),
            "stop_token_ids",
        ),
        "internal-logit_bias": (sp(logit_bias={vocab_size(): 1.0}, max_new_tokens=4), "logit_bias"),
        "internal-stop": (sp(stop=[f"s{i}" for i in range(1000)], max_new_tokens=4), "stop"),
        "internal-n": (sp(max_new_tokens=4, n=bounds.MAX_N + 1), "n"),
    }


async def stream_greedy(client: httpx.AsyncClient, ids: list[int], started: asyncio.Event) -> list[int]:
    """Output ids of a streamed greedy /generate; sets ``started`` at its first token."""
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {
            "temperature": 0,
            "max_new_tokens": NEW_TOKENS,
            "min_new_tokens": NEW_TOKENS,
        },
    }
    out: list[int] = []
    async with client.stream("POST", "/generate", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                out = chunk["output_ids"]
                started.set()
    return out


async def send_bad(stack: Stack, client: httpx.AsyncClient) -> dict[str, tuple[int | str, str]]:
    """Every bad request at once: id -> (HTTP status or gRPC code name, error message)."""
    results: dict[str, tuple[int | str, str]] = {}

    async def http(name: str, path: str, body: dict, field: str) -> None:
        r = await client.post(path, json={k: v for k, v in body.items() if v is not None})
        error = r.json().get("error", {})
        results[name] = (r.status_code, f"{error.get('param')}|{error.get('message')}")
        assert error.get("param") == field, (name, r.text[:300])

    async def public(name: str, request: api_pb2.GenerateRequest) -> None:
        async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
            try:
                async for _ in api_pb2_grpc.PdServeStub(channel).Generate(request, timeout=30):
                    pass
                results[name] = ("OK", "")
            except grpc.aio.AioRpcError as e:
                results[name] = (e.code().name, e.details())

    async def internal(name: str, params: common_pb2.SamplingParams) -> None:
        decode = f"127.0.0.1:{stack.internal_port_base + 20}"
        request = scheduler_pb2.TokenizedGenerateReqInput(
            rid=f"poison-{name}", input_ids=[1, 2, 3], sampling_params=params,
            prefill_address=f"127.0.0.1:{stack.internal_port_base + 10}",
            output_address=f"127.0.0.1:{stack.internal_port_base + 2}", gateway_address="127.0.0.1:1",
        )  # fmt: skip
        async with grpc.aio.insecure_channel(decode) as channel:
            try:
                await scheduler_pb2_grpc.DecodeSchedulerStub(channel).Generate(request, timeout=30)
                results[name] = ("OK", "")
            except grpc.aio.AioRpcError as e:
                results[name] = (e.code().name, e.details())

    await asyncio.gather(
        *(http(name, *case()) for name, case in BAD_HTTP.items()),
        *(public(name, request) for name, (request, _) in bad_grpc().items()),
        *(internal(name, params) for name, (params, _) in bad_internal().items()),
    )
    return results


async def poison(stack: Stack, mid_decode: bool) -> None:
    cases = greedy_cases()
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        first_tokens = [asyncio.Event() for _ in cases]
        good = [
            asyncio.create_task(stream_greedy(client, ids, event))
            for (ids, _), event in zip(cases, first_tokens, strict=True)
        ]
        if mid_decode:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_tokens)), timeout=240)
            assert not all(t.done() for t in good), "the 8 finished before the bad requests arrived"
        sent = time.monotonic()
        results = await send_bad(stack, client)
        answered = time.monotonic()
        outputs = await asyncio.gather(*good)
    statuses = sorted(Counter(str(status) for status, _ in results.values()).items())
    print(
        f"\npoison ({'mid-decode' if mid_decode else 'together'}): {len(results)} bad requests sent after "
        f"{sent - started:.1f} s, all answered in {answered - sent:.1f} s; the 8 done after "
        f"{time.monotonic() - started:.1f} s; statuses {statuses}"
    )
    for name, (status, message) in results.items():
        if name in BAD_HTTP:
            assert status == 400, (name, status, message)
    for name, (_, field) in bad_grpc().items():
        assert results[name][0] == "INVALID_ARGUMENT" and field in results[name][1], (name, results[name])
    for name, (_, field) in bad_internal().items():
        assert results[name][0] == "INVALID_ARGUMENT" and field in results[name][1], (name, results[name])
    for (ids, expected), got in zip(cases, outputs, strict=True):
        assert got == expected, (hf_tokenizer().decode(ids), got, expected)


@pytest.mark.parametrize("mid_decode", [False, True], ids=["together", "mid-decode"])
def test_bad_requests_fail_alone_colocated(colocated, mid_decode) -> None:
    asyncio.run(poison(colocated, mid_decode))


@pytest.mark.parametrize("mid_decode", [False, True], ids=["together", "mid-decode"])
def test_bad_requests_fail_alone_pd(stack, mid_decode) -> None:
    asyncio.run(poison(stack, mid_decode))
