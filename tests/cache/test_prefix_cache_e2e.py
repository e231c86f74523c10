"""Issue 4 on the real stack: a shared 500-token prefix is extended once, then reused."""

from __future__ import annotations

import httpx

from tests.reference import hf_greedy, hf_tokenizer

PAGE = 16


def hits(stack) -> tuple[float, float]:
    m = stack.metrics()
    return (
        sum(v for k, v in m["pdserve:prefix_cache_hit_tokens_total"].items() if k[0] == "mixed"),
        sum(v for k, v in m["pdserve:prompt_tokens_total"].items() if k[0] == "mixed"),
    )


def test_shared_500_token_prefix_extends_only_the_suffix(colocated):
    tok = hf_tokenizer()
    prefix = tok(" ".join(f"Rule {i}: be kind to everyone." for i in range(70)))["input_ids"][:500]
    first = prefix + tok(" Question: what is rule 3?")["input_ids"]
    second = prefix + tok(" Question: name a kind act.")["input_ids"]
    params = {"temperature": 0, "max_new_tokens": 12}
    r1 = httpx.post(
        f"{colocated.base_url}/generate", json={"input_ids": first, "sampling_params": params}, timeout=300
    )
    assert r1.status_code == 200, r1.text
    hit0, prompt0 = hits(colocated)
    r2 = httpx.post(
        f"{colocated.base_url}/generate", json={"input_ids": second, "sampling_params": params}, timeout=300
    ).json()
    hit1, prompt1 = hits(colocated)
    cached = len(prefix) // PAGE * PAGE
    assert prompt1 - prompt0 == len(second)
    assert hit1 - hit0 >= cached  # only len(second) - cached tokens were extended
    assert r2["meta_info"]["cached_tokens"] >= cached
    assert r2["output_ids"] == hf_greedy(second, 12)  # the same tokens as without the cache


def test_openai_usage_reports_cached_prompt_tokens(colocated):
    import openai

    client = openai.OpenAI(base_url=f"{colocated.base_url}/v1", api_key="none")
    system = "You answer in one word. " * 60
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Colour of grass?"}]
    client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=4
    )
    messages[1]["content"] = "Colour of snow?"
    resp = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=4
    )
    assert resp.usage.prompt_tokens_details.cached_tokens >= 16 * 16
