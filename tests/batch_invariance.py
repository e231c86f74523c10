"""Requests for the stack-level batch-invariance tests: probes whose outputs must not depend on the
batch, other requests of other lengths to batch them with, and how they are sent."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.reference import chat_ids
from tests.stack import Stack

PROBES = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences how a bicycle stays upright while it moves forward.",
]
OTHERS = [
    "Hi",
    "Name a colour.",
    "List five fruits and say which is the sweetest one of them.",
    "Tell me a story about a dragon who lived under a mountain and collected old clocks.",
    "What is 17 times 23?",
    "Describe a city at night. " * 6,
    "Translate 'good morning' into French, German and Spanish.",
    "Why is the sky blue? Answer like a physicist who is also a poet.",
    "Write a limerick about a cat.",
    "Summarize: the quick brown fox jumps over the lazy dog. " * 10,
    "Give me three tips for learning to play the piano as an adult.",
    "What are the primary colours?",
    "Explain recursion to a child.",
    "Compose a short email declining an invitation to a meeting.",
    "Count from one to twenty in words.",
]


def generate(stack: Stack, question: str, max_tokens: int = 24) -> tuple:
    """The greedy output ids, their logprobs and top-2 logprobs of a chat question via /generate."""
    body = {
        "input_ids": chat_ids([{"role": "user", "content": question}]),
        "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    resp = httpx.post(f"{stack.base_url}/generate", json=body, timeout=600)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    meta = out["meta_info"]
    return out["output_ids"], meta["output_token_logprobs"], meta["output_top_logprobs"]


def batched(stack: Stack, questions: list[str]) -> list[tuple]:
    """All ``questions`` sent at once (other lengths and output lengths: a changing batch)."""
    lengths = [24 if q in PROBES else 8 + 3 * i for i, q in enumerate(questions)]
    with ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(lambda args: generate(stack, *args), zip(questions, lengths, strict=True)))


def assert_invariant(stack: Stack, alone: dict[str, tuple]) -> None:
    """The probes sent among ``OTHERS`` at once, then each again (a radix-cache hit), give ``alone``'s
    outputs; afterwards the stack is idle with its KV pools conserved."""
    mixed = [*OTHERS[:7], PROBES[0], *OTHERS[7:12], PROBES[1], *OTHERS[12:], PROBES[2]]
    results = dict(zip(mixed, batched(stack, mixed), strict=True))
    for q in PROBES:
        assert results[q] == alone[q], ("batched", q)
        assert generate(stack, q) == alone[q], ("alone again, cached", q)
    stack.wait_idle()
    stack.check_kv_conservation()
