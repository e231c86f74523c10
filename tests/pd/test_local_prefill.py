"""Conditional disaggregation: with the launcher's default on a CPU, a PD decode worker prefills a
prompt of at most one chunk (512 uncached tokens) itself and asks its prefill worker for longer
ones; greedy outputs equal HF transformers fp32 either way, and the pools are conserved."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdserve.scheduler.config import SchedulerConfig
from tests.conftest import COMMON
from tests.reference import hf_greedy, hf_tokenizer
from tests.stack import launch_stack

MAX_TOKENS = 16
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M fp32: layers x (K, V) x KV heads x head dim x 4
SHORT = ["Write one sentence about the sea.", "List three colours of the rainbow."]
# ~700 tokens: longer than one chunk, so its KV comes from the prefill worker
LONG = "Summarize the following notes in one line. " + " ".join(
    f"Note {i}: the shipment of crate {i * 7} left the harbour at {i % 12 + 1} o'clock." for i in range(40)
)


@pytest.fixture(scope="module")
def pd():
    stack = launch_stack(
        "--num-prefill",
        "1",
        "--num-decode",
        "1",
        *COMMON,
        log_name="local-prefill",
        remote_prefill_only=False,
    )
    yield stack
    stack.stop()


def generate(stack, prompts: list[str]) -> list[list[int]]:
    """Greedy output ids of ``prompts``, sent at once to the native /generate endpoint."""

    async def one(http: httpx.AsyncClient, prompt: str) -> list[int]:
        body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS}}
        resp = await http.post(f"{stack.base_url}/generate", json=body, timeout=300)
        assert resp.status_code == 200, resp.text
        return resp.json()["output_ids"]

    async def all_of_them():
        async with httpx.AsyncClient() as http:
            return await asyncio.gather(*(one(http, p) for p in prompts))

    return asyncio.run(all_of_them())


def counters(stack) -> tuple[float, float]:
    """(requests the decode worker prefilled itself, KV bytes moved over NIXL) so far."""
    local = sum(stack.scheduler_values("pdserve:local_prefills_total").values())
    moved = sum(stack.scheduler_values("pdserve:kv_transfer_bytes_total").values())
    return local, moved


def test_short_prompts_prefill_on_the_decode_worker_and_long_ones_on_the_prefill_worker(pd):
    tok = hf_tokenizer()
    long_ids = tok(LONG)["input_ids"]
    assert 512 < len(long_ids) < 1024
    local0, moved0 = counters(pd)
    outputs = generate(pd, [*SHORT, LONG])
    for prompt, output in zip([*SHORT, LONG], outputs, strict=True):
        assert output == hf_greedy(tok(prompt)["input_ids"], MAX_TOKENS), prompt[:40]
    local, moved = counters(pd)
    assert local - local0 == len(SHORT)
    assert moved - moved0 >= len(long_ids) // 16 * 16 * KV_BYTES_PER_TOKEN  # the long prompt's whole pages
    pd.check_kv_conservation()


def test_a_long_prompt_cached_on_the_decode_worker_then_extended_locally(pd):
    """A long prompt's KV, written by the prefill worker, stays in the decode worker's radix cache;
    the same prompt with a question after it then lacks few tokens, and is prefilled here from the
    cached pages."""
    tok = hf_tokenizer()
    context = LONG.replace("harbour", "port")
    follow_up = context + " Which crate left last?"
    _, moved0 = counters(pd)
    generate(pd, [context])
    local1, moved1 = counters(pd)
    assert moved1 > moved0
    (output,) = generate(pd, [follow_up])
    assert output == hf_greedy(tok(follow_up)["input_ids"], MAX_TOKENS)
    local, moved = counters(pd)
    assert (local - local1, moved - moved1) == (1, 0)
    pd.check_kv_conservation()


def test_the_limit_is_a_pd_decode_workers_and_not_negative():
    with pytest.raises(ValueError, match="decode role"):
        SchedulerConfig(role="mixed", local_prefill_max_tokens=64).validate()
    with pytest.raises(ValueError, match=">= 0"):
        SchedulerConfig(role="decode", local_prefill_max_tokens=-1).validate()
    SchedulerConfig(role="decode", local_prefill_max_tokens=64).validate()
