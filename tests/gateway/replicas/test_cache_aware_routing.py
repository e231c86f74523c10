"""Cache-aware routing keeps a conversation on one decode worker, measured by the schedulers' metrics.

Two gateway replicas share two colocated decode workers: the launcher's gateway routes
``round_robin``, the second replica ``cache_aware``. Each gets its own conversations: a long document
(distinct per conversation and per policy, so neither run's cache helps the other) as the system
message, then several questions about it, one request at a time. Requests go one by one, so the
worker whose ``pdserve:prompt_tokens`` counter moved by the prompt's length is the one that served it,
and its ``pdserve:prefix_cache_hit_tokens`` delta is that request's radix-cache hit.

Expected hits come from the HF tokenizer: the longest common prefix with any earlier prompt of the
run on the same worker, in whole pages (other tests' prompts share less than a page with these).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.replicas.conftest import PAGE_SIZE
from tests.reference import chat_ids
from tests.stack import Stack

MODEL = "SmolLM2-135M-Instruct"
NUM_CONVERSATIONS = 3
QUESTIONS = ["What is the document about?", "Which word comes first?", "Summarise it in five words."]
WORDS = ["river", "stone", "lantern", "orchard", "copper", "meadow", "harbour", "violet", "glacier", "heron"]
SCHEDULER_ROLES = ("mixed", "decode")


@dataclass
class Served:
    """One request as the schedulers' metrics saw it."""

    conversation: int
    prompt_ids: list[int]
    worker: str
    hit_tokens: int


def document(policy: str, k: int, rng: random.Random) -> str:
    """About 330 tokens of text; its first word (policy and conversation) differs from every other's."""
    return f"{policy.title()}{k} notes. " + " ".join(rng.choice(WORDS) for _ in range(300))


def scheduler_counters(stack: Stack) -> dict[str, dict[str, float]]:
    """``{metric: {decode worker: value}}`` of the prompt-token and cache-hit counters."""
    text = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
    names = ("pdserve:prompt_tokens_total", "pdserve:prefix_cache_hit_tokens_total")
    out: dict[str, dict[str, float]] = {name: {} for name in names}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names and s.labels["role"] in SCHEDULER_ROLES:
                out[s.name][s.labels["worker"]] = s.value
    return out


def run_conversations(gateway: Stack, backend: Stack, policy: str) -> list[Served]:
    """Send every conversation's questions in turn through ``gateway``; attribute each by the metrics."""
    rng = random.Random(policy)
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="none", max_retries=0)
    served = []
    for k in range(NUM_CONVERSATIONS):
        doc = document(policy, k, rng)
        for question in QUESTIONS:
            messages = [{"role": "system", "content": doc}, {"role": "user", "content": question}]
            before = scheduler_counters(backend)
            resp = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=2)
            after = scheduler_counters(backend)
            delta = {
                name: {w: v - before[name].get(w, 0.0) for w, v in values.items()}
                for name, values in after.items()
            }
            moved = {w: d for w, d in delta["pdserve:prompt_tokens_total"].items() if d}
            prompt_ids = chat_ids(messages)
            assert len(moved) == 1 and list(moved.values()) == [len(prompt_ids)], moved
            (worker,) = moved
            hits = delta["pdserve:prefix_cache_hit_tokens_total"]
            assert not any(d for w, d in hits.items() if w != worker), hits
            assert resp.usage.prompt_tokens_details.cached_tokens == hits[worker]
            served.append(Served(k, prompt_ids, worker, int(hits[worker])))
    return served


def expected_hit(earlier: list[Served], now: Served) -> int:
    """Whole pages of the longest common prefix with a prompt served earlier on the same worker."""
    common = [_common_prefix(s.prompt_ids, now.prompt_ids) for s in earlier if s.worker == now.worker]
    return max(common, default=0) // PAGE_SIZE * PAGE_SIZE


def workers_of(run: list[Served], conversation: int) -> set[str]:
    return {s.worker for s in run if s.conversation == conversation}


def hit_rate(served: list[Served]) -> float:
    return sum(s.hit_tokens for s in served) / sum(len(s.prompt_ids) for s in served)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_cache_aware_keeps_conversations_on_one_worker(two_decode: Stack, cache_aware_gateway: Stack) -> None:
    round_robin = run_conversations(two_decode, two_decode, "round_robin")
    cache_aware = run_conversations(cache_aware_gateway, two_decode, "cache_aware")
    for run in (round_robin, cache_aware):
        assert [s.hit_tokens for s in run] == [expected_hit(run[:i], s) for i, s in enumerate(run)]
    assert all(len(workers_of(cache_aware, k)) == 1 for k in range(NUM_CONVERSATIONS))
    assert all(len(workers_of(round_robin, k)) == 2 for k in range(NUM_CONVERSATIONS))
    rr_rate, ca_rate = hit_rate(round_robin), hit_rate(cache_aware)
    print(f"prefix hit rate: round_robin {rr_rate:.3f}, cache_aware {ca_rate:.3f}")
    # Every later question of a conversation hits with cache_aware; with round_robin on two workers,
    # only the questions that land where the conversation has been before do.
    assert ca_rate > rr_rate + 0.2, (rr_rate, ca_rate)
