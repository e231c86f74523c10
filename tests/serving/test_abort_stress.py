"""Issue 5: 200 requests aborted at random times leave nothing behind in any service."""

from __future__ import annotations

import asyncio
import random

import httpx

from tests.stack import Stack


async def _one(client: httpx.AsyncClient, base_url: str, i: int, walk_away_after: float) -> str:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": f"Request {i}: write a long list of numbers.",
        "max_tokens": 48,
        "temperature": 0.7,
        "seed": i,
        "ignore_eos": True,
        "stream": i % 2 == 0,
    }
    try:
        async with asyncio.timeout(walk_away_after):
            if body["stream"]:
                async with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
                    async for _ in resp.aiter_lines():
                        pass
                    return str(resp.status_code)
            resp = await client.post(f"{base_url}/v1/completions", json=body)
            return str(resp.status_code)
    except TimeoutError:
        return "walked away"


def abort_stress(stack: Stack, seed: int = 1234) -> None:
    """200 completions (half streamed, sampled) each abandoned at a random time in 0.05-6 s; then
    every scheduler is idle with its KV pool conserved and no detokenizer stream is left."""
    rng = random.Random(seed)
    delays = [rng.uniform(0.05, 6.0) for _ in range(200)]

    async def run():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_one(client, stack.base_url, i, d) for i, d in enumerate(delays)))

    outcomes = asyncio.run(run())
    assert outcomes.count("walked away") >= 50, outcomes  # most of them really were aborted
    assert set(outcomes) <= {"200", "walked away", "429"}, set(outcomes)
    stack.wait_idle(timeout=15)
    stack.check_kv_conservation()
    active = stack.metrics().get("pdserve:detokenizer_active_streams", {})
    assert sum(active.values()) == 0, active


def test_200_requests_with_random_abort_times_leak_nothing(stack):
    abort_stress(stack)
