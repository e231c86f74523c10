"""Speculative decoding through real stacks (``pdserve launch``, the official ``openai`` client):
colocated with n-gram drafts and PD with a draft model (the decode worker drafts and verifies; the
prefill worker is unchanged), drafts verified always. Greedy answers are HF transformers fp32's
token for token, the spec_decode counters move, a per-request opt-out and an out-of-range value are
honoured / refused with a 400, and KV pages are conserved on every scheduler after each test."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import openai
import pytest

from benchmarks.serving_lib.client import CompletionTarget, stream_completion
from tests.conftest import COMMON
from tests.reference import chat_ids, hf_greedy, hf_tokenizer
from tests.stack import SERVED_MODEL, Stack, launch_stack

SPEC = ("--speculative-num-draft-tokens", "4", "--speculative-policy", "always")
# colocated: n-gram drafts; PD: the decode worker drafts with a draft model of its own (the target
# itself, which must accept every greedy draft), whose KV it computes there: prefill ships only the
# target's (n-gram drafts in PD run in tests/tp, under TP)
MODES = {
    "colocated-ngram": ("--colocated", "--speculative-algorithm", "ngram"),
    "pd-draft": (
        "--num-prefill", "1", "--num-decode", "1",
        "--speculative-algorithm", "draft", "--speculative-draft-model-path", "smollm2-135m-instruct",
    ),
}  # fmt: skip
PASSAGE = (
    "The lighthouse keeper climbed the stairs every evening at dusk, trimmed the wick, polished the "
    "great lens and watched the ships pass the rocks until morning."
)
QUESTIONS = (f"Repeat this sentence exactly:\n\n{PASSAGE}", "Name three colors.")
MAX_TOKENS = 32


@pytest.fixture(scope="module", params=sorted(MODES))
def stack(request) -> Stack:
    stack = launch_stack(*MODES[request.param], *SPEC, *COMMON, log_name=f"spec-{request.param}")
    yield stack
    stack.stop()


@pytest.fixture
def spec(stack: Stack) -> Stack:
    yield stack
    stack.check_kv_conservation()


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0, http_client=httpx.Client()
    )


def counter(stack: Stack, name: str) -> float:
    return sum(stack.metrics().get(f"pdserve:spec_decode_{name}_total", {}).values())


def test_greedy_answers_are_hfs_with_drafts_verified(spec) -> None:
    before = counter(spec, "num_accepted_tokens")
    with client(spec) as c:
        for question in QUESTIONS:
            resp = c.chat.completions.create(
                model=SERVED_MODEL,
                messages=[{"role": "user", "content": question}],
                temperature=0,
                max_tokens=MAX_TOKENS,
            )
            expected = hf_greedy(chat_ids([{"role": "user", "content": question}]), MAX_TOKENS)
            assert resp.choices[0].message.content == hf_tokenizer().decode(
                expected, skip_special_tokens=True
            )
            assert resp.usage.completion_tokens == len(expected)
    assert counter(spec, "num_accepted_tokens") - before >= 10  # the repeated sentence's drafts stand
    assert counter(spec, "num_draft_tokens") >= counter(spec, "num_accepted_tokens")


def test_opt_out_and_bounds(spec) -> None:
    before = counter(spec, "num_draft_tokens")
    question = QUESTIONS[0]
    with client(spec) as c:
        resp = c.chat.completions.create(
            model=SERVED_MODEL,
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=16,
            extra_body={"speculative_num_draft_tokens": 0},
        )
        expected = hf_greedy(chat_ids([{"role": "user", "content": question}]), 16)
        assert resp.choices[0].message.content == hf_tokenizer().decode(expected, skip_special_tokens=True)
        assert counter(spec, "num_draft_tokens") == before  # nothing drafted for it
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(
                model=SERVED_MODEL,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=4,
                extra_body={"speculative_num_draft_tokens": 17},
            )
        assert "speculative_num_draft_tokens" in str(e.value)


def test_the_benchmark_times_each_accepted_token(spec) -> None:
    """`make bench`'s client spreads a chunk's gap over the tokens it brings (SGLang's per-token ITL):
    a speculative step streams several tokens in one chunk, and every token after the first chunk
    gets an ITL sample."""
    target = CompletionTarget(
        openai.AsyncOpenAI(base_url=f"{spec.base_url}/v1", api_key="none", max_retries=0),
        SERVED_MODEL,
        output_tokens=MAX_TOKENS,
    )
    record = asyncio.run(stream_completion(target, f"{PASSAGE}\n\n{PASSAGE}\n\n{PASSAGE}", 0))
    assert record.error is None and record.output_tokens == MAX_TOKENS
    # the first chunk brings 1 to k + 1 = 5 tokens; every later token one sample
    assert MAX_TOKENS - 5 <= len(record.itl) <= MAX_TOKENS - 1
    chunks = 1 + sum(1 for a, b in itertools.pairwise(record.itl) if a != b)
    assert chunks < len(record.itl)  # fewer chunks than tokens: drafts stood
    assert record.ttft + sum(record.itl) <= record.latency
