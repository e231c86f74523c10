"""What the TP stack tests share: requests through the real gateway, HF references, the group checks."""

from __future__ import annotations

import asyncio

import httpx

from tests.reference import chat_ids, hf_greedy, hf_tokenizer
from tests.stack import Stack

PROMPTS = [
    "What is the capital of France?",
    "Name three animals that live in the ocean.",
    "Write a haiku about autumn leaves.",
]


def generate(stack: Stack, input_ids: list[int], max_new_tokens: int = 24, **params) -> dict:
    """Greedy ``/generate``; the response body (asserts HTTP 200)."""
    return generate_all(stack, [input_ids], max_new_tokens, **params)[0]


def generate_all(stack: Stack, prompts: list[list[int]], max_new_tokens: int, **params) -> list[dict]:
    """Greedy ``/generate`` of every prompt at once; the response bodies (asserts HTTP 200)."""
    sampling = {"temperature": 0, "max_new_tokens": max_new_tokens, **params}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=600) as client:
            url = f"{stack.base_url}/generate"
            calls = [
                client.post(url, json={"input_ids": ids, "sampling_params": sampling}) for ids in prompts
            ]
            return await asyncio.gather(*calls)

    responses = asyncio.run(run())
    for resp in responses:
        assert resp.status_code == 200, resp.text
    return [resp.json() for resp in responses]


def check_greedy_equals_hf(stack: Stack) -> None:
    prompts = [chat_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    for ids, result in zip(prompts, generate_all(stack, prompts, 24), strict=True):
        assert result["output_ids"] == hf_greedy(ids, 24), hf_tokenizer().decode(ids)


def check_chunked_prefill_and_radix_hit(stack: Stack) -> None:
    """A prompt longer than several prefill chunks; then the same prompt again, from the cache."""
    ids = chat_ids([{"role": "user", "content": "Summarize: " + "the cat sat on the mat. " * 40}])
    expected = hf_greedy(ids, 12)
    first = generate(stack, ids, 12)
    again = generate(stack, ids, 12)
    assert first["output_ids"] == expected
    assert again["output_ids"] == expected
    assert again["meta_info"]["cached_tokens"] >= len(ids) // 16 * 16 - 16


def check_retraction(stack: Stack, requests: int, prompt_len: int, new_tokens: int) -> None:
    """More concurrent growth than the KV pool holds: requests are retracted and re-extended, and
    still give HF's tokens (EOS banned on both sides, so every request grows to the end). They opt out
    of speculation (a short pool drops drafts before it retracts anyone)."""
    text = hf_tokenizer()(" ".join(f"Item {i} is a small round stone." for i in range(400)))["input_ids"]
    prompts = [text[i * 37 : i * 37 + prompt_len] for i in range(requests)]
    before = retracted(stack)
    results = generate_all(
        stack, prompts, new_tokens, min_new_tokens=new_tokens, speculative_num_draft_tokens=0
    )
    assert retracted(stack) > before, "the pool was large enough: nothing was retracted"
    for ids, result in zip(prompts, results, strict=True):
        assert result["output_ids"] == hf_greedy(ids, new_tokens, min_new_tokens=new_tokens)


def check_aborts(stack: Stack, n: int = 6) -> None:
    """Streams that the client walks away from mid-generation."""

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": f"Request {i}: write a long list of numbers.", "max_tokens": 64, "ignore_eos": True,
                "temperature": 0, "stream": True, "model": "SmolLM2-135M-Instruct"}  # fmt: skip
        chunks = 0
        async with client.stream("POST", f"{stack.base_url}/v1/completions", json=body) as resp:
            async for _ in resp.aiter_lines():
                chunks += 1
                if chunks >= 3 + i:
                    break  # closes the stream: the gateway aborts the request everywhere
        return chunks

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    assert all(c >= 3 for c in asyncio.run(run()))


def retracted(stack: Stack) -> float:
    return sum(stack.scheduler_values("pdserve:num_retracted_reqs_total").values())


def tp_state_checks(stack: Stack) -> float:
    """Steps after which every scheduler's ranks compared their state digests (and found them equal:
    a difference takes the group down)."""
    return sum(stack.scheduler_values("pdserve:tp_state_checks_total").values())


def check_group(stack: Stack, checks_before: float) -> float:
    """After a test: idle, every pool conserved, and the ranks' states compared since ``checks_before``."""
    stack.check_kv_conservation()
    checks = tp_state_checks(stack)
    assert checks > checks_before, "the ranks' scheduler states were never compared"
    return checks
