"""The SDK against the launched PD stack: greedy output equals the OpenAI endpoint's, streaming, chat."""

from __future__ import annotations

import openai
import pytest
from pdserve_sdk import AsyncClient, Client, ModelCard
from transformers import AutoConfig

from pdserve.model_source import resolve_model
from tests.reference import chat_ids, hf_greedy, hf_tokenizer

PROMPT = "Once upon a time, in a small village by the sea,"
MESSAGES = [{"role": "user", "content": "Tell me a short fact about cats."}]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def oai(pd_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pd_stack.base_url}/v1", api_key="none")


@pytest.fixture(scope="module")
def model_id(oai) -> str:
    return oai.models.list().data[0].id


def test_greedy_generate_equals_openai_completion(stack, oai, model_id):
    expected = oai.completions.create(
        model=model_id, prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS, logprobs=2
    ).choices[0]
    prompt_ids = hf_tokenizer()(PROMPT)["input_ids"]
    with Client(stack.grpc_address, model=model_id) as client:
        result = client.generate(
            PROMPT, temperature=0, max_new_tokens=MAX_TOKENS, return_logprob=True, top_logprobs_num=2
        )
        by_ids = client.generate(input_ids=prompt_ids, temperature=0, max_new_tokens=MAX_TOKENS)
    assert result.text == expected.text
    assert result.finish_reason == expected.finish_reason == "length"
    assert result.text == hf_tokenizer().decode(result.token_ids, skip_special_tokens=True)
    assert by_ids.token_ids == result.token_ids
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (
        len(prompt_ids),
        len(result.token_ids),
    )
    assert [lp.token_id for lp in result.logprobs] == result.token_ids
    # greedy: the chosen token is the most likely one, and its logprob is the one OpenAI's endpoint reports
    assert all(lp.top[0].token_id == lp.token_id and len(lp.top) == 2 for lp in result.logprobs)
    assert [lp.logprob for lp in result.logprobs] == pytest.approx(expected.logprobs.token_logprobs, abs=1e-4)


def test_logit_bias_bans_and_favours_tokens(stack):
    prompt_ids = hf_tokenizer()(PROMPT)["input_ids"]
    plain = hf_greedy(prompt_ids, MAX_TOKENS)
    bias = {plain[0]: -100.0, plain[1]: -100.0}
    with Client(stack.grpc_address) as client:
        result = client.generate(
            input_ids=prompt_ids, temperature=0, max_new_tokens=MAX_TOKENS, logit_bias=bias
        )
    assert result.token_ids == hf_greedy(prompt_ids, MAX_TOKENS, logit_bias=bias)
    assert not {plain[0], plain[1]} & set(result.token_ids)


def test_stream_deltas_concatenate_to_generate(stack):
    with Client(stack.grpc_address) as client:
        whole = client.generate(PROMPT, temperature=0, max_new_tokens=MAX_TOKENS)
        stream = client.stream(PROMPT, temperature=0, max_new_tokens=MAX_TOKENS)
        deltas = list(stream)
    assert len(deltas) > 1
    assert "".join(d.text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [whole.finish_reason]
    assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == len(whole.token_ids)
    assert {d.rid for d in deltas} == {stream.rid} and stream.rid


def test_chat_equals_openai_chat(stack, oai, model_id):
    expected = oai.chat.completions.create(model=model_id, messages=MESSAGES, temperature=0, max_tokens=24)
    with Client(stack.grpc_address) as client:
        result = client.chat(MESSAGES, temperature=0, max_new_tokens=24)
        streamed = "".join(d.text for d in client.chat_stream(MESSAGES, temperature=0, max_new_tokens=24))
    assert result.text == expected.choices[0].message.content == streamed
    assert result.usage.prompt_tokens == len(chat_ids(MESSAGES)) == expected.usage.prompt_tokens


def test_chat_text_parts_equal_the_joined_string(stack, oai, model_id):
    parts = [{"type": "text", "text": "Tell me a short "}, {"type": "text", "text": "fact about cats."}]
    assert "".join(p["text"] for p in parts) == MESSAGES[0]["content"]
    by_parts = [{"role": "user", "content": parts}]
    with Client(stack.grpc_address) as client:
        plain = client.chat(MESSAGES, temperature=0, max_new_tokens=MAX_TOKENS)
        result = client.chat(by_parts, temperature=0, max_new_tokens=MAX_TOKENS)
    http = oai.chat.completions.create(
        model=model_id, messages=by_parts, temperature=0, max_tokens=MAX_TOKENS
    )
    assert result.token_ids == plain.token_ids
    assert result.text == plain.text == http.choices[0].message.content
    assert result.usage.prompt_tokens == plain.usage.prompt_tokens == http.usage.prompt_tokens


async def test_async_client_matches_sync(stack, model_id):
    with Client(stack.grpc_address) as client:
        expected = client.generate(PROMPT, temperature=0, max_new_tokens=MAX_TOKENS)
        expected_chat = client.chat(MESSAGES, temperature=0, max_new_tokens=MAX_TOKENS)
    async with AsyncClient(stack.grpc_address) as client:
        result = await client.generate(PROMPT, temperature=0, max_new_tokens=MAX_TOKENS)
        deltas = [d async for d in client.stream(PROMPT, temperature=0, max_new_tokens=MAX_TOKENS)]
        chat = await client.chat(MESSAGES, temperature=0, max_new_tokens=MAX_TOKENS)
        chat_streamed = [
            d.text async for d in client.chat_stream(MESSAGES, temperature=0, max_new_tokens=MAX_TOKENS)
        ]
        assert await client.health() == "SERVING"
        assert [m.id for m in await client.models()] == [model_id]
    assert result.token_ids == expected.token_ids
    assert "".join(d.text for d in deltas) == expected.text
    assert chat.text == "".join(chat_streamed) == expected_chat.text


def test_models_and_health(stack, model_id):
    context_length = AutoConfig.from_pretrained(resolve_model()).max_position_embeddings
    with Client(stack.grpc_address) as client:
        assert client.models() == [ModelCard(model_id, context_length)]
        assert client.health() == client.health("") == "SERVING"


def test_matched_stop_names_the_stop_string_or_the_stop_token(stack):
    """A choice ended by a stop string reports it in ``matched_stop``; one ended by a stop token
    (``stop_token_ids``, as EOS) reports its id in ``matched_stop_token``, so the string "2" and
    token 2 cannot be confused."""
    with Client(stack.grpc_address) as client:
        full = client.generate(PROMPT, temperature=0, max_new_tokens=MAX_TOKENS)
        token, word = full.token_ids[3], full.text.split()[2]
        by_token = client.generate(PROMPT, temperature=0, max_new_tokens=MAX_TOKENS, stop_token_ids=[token])
        by_string = client.generate(PROMPT, temperature=0, max_new_tokens=MAX_TOKENS, stop=[word])
    assert (full.finish_reason, full.choices[0].matched_stop, full.choices[0].matched_stop_token) == (
        "length",
        "",
        None,
    )
    choice = by_token.choices[0]
    assert (choice.finish_reason, choice.matched_stop, choice.matched_stop_token) == ("stop", "", token)
    choice = by_string.choices[0]
    assert (choice.finish_reason, choice.matched_stop, choice.matched_stop_token) == ("stop", word, None)
