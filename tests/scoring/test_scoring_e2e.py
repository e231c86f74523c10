"""Scoring through the served stack, colocated and PD, with chunked prefill (32-token chunks):
``echo`` + ``logprobs`` on /v1/completions (OpenAI's legacy shape, streamed and not, ``max_tokens``
0 and 1) and vLLM's ``prompt_logprobs`` on completions and chat equal HF transformers' float32
log_softmax within 1e-4, also when the prompt is in the radix cache; ``prompt_logprobs`` on native
/generate and the gRPC API (through the SDK) equal the completions' values; bad values are
OpenAI-shaped 400s. Every scheduler's KV pool is conserved after each test (the stacks: ``conftest.py``,
run with ``--schedule-policy priority``, so requests with a ``priority`` travel through the gateway
and, in PD, both schedulers, each of which refuses a priority other than 0 under another policy)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
import torch
from pdserve_sdk import Client

from tests.reference import chat_ids, hf_model, hf_prompt_logprobs, hf_tokenizer
from tests.scoring.conftest import client, computed_prompt_tokens, ranks_within_tol
from tests.stack import SERVED_MODEL

TOL = 1e-4
TEXT = (
    "Question: What is the capital of France? Answer: Paris is the capital and the largest city of "
    "France, on the river Seine, and it has been a centre of finance, diplomacy and the arts."
)


def prompt_ids() -> list[int]:
    ids = hf_tokenizer()(TEXT)["input_ids"]
    assert len(ids) > 32  # more than one chunk
    return ids


def check_echo(logprobs, prompt: list[int], top: int) -> None:
    """The legacy logprobs of an echoed ``prompt`` equal HF's; ``top`` alternatives per token."""
    ref = hf_prompt_logprobs(tuple(prompt))
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert len(logprobs.tokens) >= len(prompt)
    for pos, token in enumerate(prompt[1:], 1):
        assert abs(logprobs.token_logprobs[pos] - float(ref[pos - 1, token])) < TOL
        top_ref = ref[pos - 1].topk(top).values.tolist()
        tops = logprobs.top_logprobs[pos]  # the top ones, and the prompt token where it is not one
        assert logprobs.tokens[pos] in tops and len(tops) in (top, top + 1)
        assert sorted(tops.values(), reverse=True)[:top] == pytest.approx(top_ref, abs=TOL)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt(stack, max_tokens):
    prompt = prompt_ids()
    out = client(stack).completions.create(
        model=SERVED_MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0
    )
    choice = out.choices[0]
    check_echo(choice.logprobs, prompt, 1)
    assert len(choice.logprobs.tokens) == len(prompt) + max_tokens
    assert choice.text.startswith(hf_tokenizer().decode(prompt))
    assert out.usage.completion_tokens == max_tokens
    if max_tokens == 0:
        assert choice.text == hf_tokenizer().decode(prompt)
        assert choice.finish_reason == "length"
    else:  # the generated token follows, scored as usual (greedy: HF's argmax)
        with torch.no_grad():
            last = hf_model()(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
        assert abs(choice.logprobs.token_logprobs[-1] - float(last.max())) < TOL


def test_a_radix_hit_scores_the_same(stack):
    prompt = prompt_ids()
    c = client(stack)
    c.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=2, temperature=0)  # cached now
    out = c.completions.create(
        model=SERVED_MODEL, prompt=prompt, echo=True, logprobs=3, max_tokens=1, temperature=0
    )
    check_echo(out.choices[0].logprobs, prompt, 3)
    if stack.extra["topology"] == "colocated":  # (a PD decode worker may hit: prefill computes anyway)
        assert out.usage.prompt_tokens_details.cached_tokens == 0
    again = c.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # the cache still serves the rest


def test_streamed_echo_with_logprobs_gives_the_same_tokens(stack):
    prompt = prompt_ids()
    c = client(stack)
    whole = c.completions.create(
        model=SERVED_MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=3, temperature=0
    )
    tokens, token_logprobs, offsets, text = [], [], [], ""
    for chunk in c.completions.create(
        model=SERVED_MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=3, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                token_logprobs += choice.logprobs.token_logprobs
                offsets += choice.logprobs.text_offset
    lp = whole.choices[0].logprobs
    assert (tokens, offsets, text) == (lp.tokens, lp.text_offset, whole.choices[0].text)
    assert token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_vllm_prompt_logprobs_on_completions_and_chat(stack):
    prompt = prompt_ids()
    ref = hf_prompt_logprobs(tuple(prompt))
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}
    out = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=120).json()
    scored = out["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt)
    for pos, token in enumerate(prompt[1:], 1):
        entry = scored[pos][str(token)]
        assert abs(entry["logprob"] - float(ref[pos - 1, token])) < TOL
        assert entry["rank"] in ranks_within_tol(ref[pos - 1], token, TOL)  # also outside the top 2
        ranked = sorted((e for e in scored[pos].values() if e["rank"] in (1, 2)), key=lambda e: e["rank"])
        assert [e["logprob"] for e in ranked] == pytest.approx(ref[pos - 1].topk(2).values.tolist(), abs=TOL)

    messages = [{"role": "user", "content": "Name a colour."}]
    chat_prompt = chat_ids(messages)
    chat_ref = hf_prompt_logprobs(tuple(chat_prompt))
    body = {"model": SERVED_MODEL, "messages": messages, "max_tokens": 2, "prompt_logprobs": 0}
    out = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=120).json()
    scored = out["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(chat_prompt)
    for pos, token in enumerate(chat_prompt[1:], 1):
        assert list(scored[pos]) == [str(token)]  # the prompt token alone: 0 alternatives asked
        assert abs(scored[pos][str(token)]["logprob"] - float(chat_ref[pos - 1, token])) < TOL


def test_prompt_logprobs_on_generate_and_grpc_equal_the_completions(stack):
    prompt = prompt_ids()
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2, "priority": -5}
    out = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=120).json()
    want = [None] + [
        (
            pos[str(token)]["logprob"],
            sorted((e["logprob"] for e in pos.values() if e["rank"] in (1, 2)), reverse=True),
        )
        for token, pos in zip(prompt[1:], out["choices"][0]["prompt_logprobs"][1:], strict=True)
    ]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 1, "prompt_logprobs": 2},
        "priority": 3,
    }
    meta = httpx.post(f"{stack.base_url}/generate", json=body, timeout=120).json()["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == prompt and meta["input_top_logprobs"][0] is None
    assert meta["input_token_logprobs"][0][0] is None
    for pos in range(1, len(prompt)):
        assert meta["input_token_logprobs"][pos][0] == pytest.approx(want[pos][0], abs=1e-6)
        assert [lp for lp, _, _ in meta["input_top_logprobs"][pos]] == pytest.approx(want[pos][1], abs=1e-6)
    with Client(stack.grpc_address) as sdk:
        result = sdk.generate(input_ids=prompt, max_new_tokens=1, prompt_logprobs=2, priority=1, timeout=120)
    scored = result.choices[0].prompt_logprobs
    assert [lp.token_id for lp in scored] == prompt[1:]
    for pos, lp in enumerate(scored, 1):
        assert lp.logprob == pytest.approx(want[pos][0], abs=1e-6)
        assert [t.logprob for t in lp.top] == pytest.approx(want[pos][1], abs=1e-6)


def test_n_samples_score_their_prompt_once(stack):
    prompt = hf_tokenizer()("Scores once: " + TEXT + " " + TEXT)["input_ids"]  # in no cache yet
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1}
    body |= {"prompt_logprobs": 2, "temperature": 1.0, "seed": 7}
    before = computed_prompt_tokens(stack)
    r = httpx.post(f"{stack.base_url}/v1/completions", json={**body, "n": 4}, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    computed = computed_prompt_tokens(stack) - before
    # one sample computes the whole prompt; the others only what follows its cached pages (< a page)
    assert computed <= len(prompt) + 3 * 16, computed
    one = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=120)
    want = one.json()["choices"][0]["prompt_logprobs"]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for choice in out["choices"]:
        assert choice["prompt_logprobs"] == want
        lp = choice["logprobs"]
        check_echo(SimpleNamespace(**lp), prompt, 1)  # HF's, through each choice's echoed logprobs


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": SERVED_MODEL, "prompt": "Hi", "priority": -1001}, "priority"),
        ("/generate", {"text": "Hi", "priority": 1001}, "priority"),
        (
            "/generate",
            {"text": "Hi", "sampling_params": {"prompt_logprobs": 21}},
            "sampling_params.prompt_logprobs",
        ),
    ],
)
def test_bad_priority_and_native_prompt_logprobs_are_400s(stack, path, body, param):
    r = httpx.post(f"{stack.base_url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "Hi", "echo": True, "logprobs": 21}, "logprobs"),
        ({"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "Hi", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1] * 4097, "echo": True, "logprobs": 0, "max_tokens": 1}, "prompt"),
        # every choice carries the prompt's logprobs: 3 x 4,000 positions > 8,192 in one response
        ({"prompt": [1] * 4000, "prompt_logprobs": 1, "n": 3, "max_tokens": 1}, "n"),
        ({"prompt": [[1] * 3000] * 3, "echo": True, "logprobs": 0, "max_tokens": 1}, "n"),
    ],
)
def test_bad_scoring_requests_are_400s(stack, body, param):
    r = httpx.post(f"{stack.base_url}/v1/completions", json={"model": SERVED_MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, json.dumps(error)
