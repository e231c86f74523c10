"""``--model`` as a Hub repo id (offline, from the HF cache), ``--served-model-name`` aliases,
``--max-model-len`` and ``--chat-template``, on the running operations stack."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from pdserve.model_source import resolve_model
from tests.ops.conftest import CHAT_TEMPLATE, MAX_MODEL_LEN, SERVED_NAMES, OpsStack

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_served_names_and_context_come_from_the_flags(ops_stack: OpsStack) -> None:
    models = httpx.get(f"{ops_stack.base_url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == list(SERVED_NAMES)
    assert all(m["max_model_len"] == MAX_MODEL_LEN for m in models)
    client = ops_stack.client()
    for name in SERVED_NAMES:  # the alias is accepted; responses report the first name
        resp = client.completions.create(model=name, prompt="Hello", max_tokens=2, temperature=0)
        assert resp.model == SERVED_NAMES[0]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=2)


def test_max_model_len_bounds_prompt_and_output(ops_stack: OpsStack) -> None:
    client = ops_stack.client()
    ids = [1000 + i % 500 for i in range(MAX_MODEL_LEN - 8)]
    resp = client.completions.create(
        model=SERVED_NAMES[0], prompt=ids, temperature=0, extra_body={"ignore_eos": True}
    )
    # no max_tokens: what the context leaves, then the request ends at the context length
    assert (resp.usage.completion_tokens, resp.choices[0].finish_reason) == (8, "length")
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {MAX_MODEL_LEN}"):
        client.completions.create(model=SERVED_NAMES[0], prompt=ids, max_tokens=9)
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {MAX_MODEL_LEN}"):
        client.completions.create(model=SERVED_NAMES[0], prompt=ids + [1] * 8, max_tokens=1)


def test_chat_template_flag_replaces_the_models(ops_stack: OpsStack) -> None:
    hf = AutoTokenizer.from_pretrained(resolve_model())
    ours = hf.apply_chat_template(
        MESSAGES, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    own = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ours != own and ours.endswith("Ops says:")
    expected = hf.encode(ours, add_special_tokens=False)
    got = httpx.post(f"{ops_stack.base_url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()
    assert got["tokens"] == expected
    resp = ops_stack.client().chat.completions.create(
        model=SERVED_NAMES[0], messages=MESSAGES, max_tokens=4, temperature=0
    )
    assert resp.usage.prompt_tokens == len(expected)
