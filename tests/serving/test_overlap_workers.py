"""A colocated stack with the overlap loop forced on, two gateway workers and a stream interval of 3.

On a CPU whose every core the forward's threads take (this machine, CI's) the rest of the suite's
stacks run the step-by-step loop (the default there, ``overlap_schedule``); here the same HF-exact
outputs must come out of the overlapped loop, through either of two gateway processes that share the
ports (each must get connections), with every SSE event carrying up to three tokens.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from tests.conftest import COMMON
from tests.reference import chat_ids, hf_greedy, hf_tokenizer
from tests.stack import SERVED_MODEL, Stack, launch_stack

FLAGS = ("--colocated", "--enable-overlap-schedule", "--gateway-workers", "2", "--stream-interval", "3")
QUESTIONS = ("Name one fruit.", "What colour is the sky?", "Say hello.", "Count to three.")


@pytest.fixture(scope="module")
def stack_on() -> Stack:
    stack = launch_stack(*FLAGS, *COMMON, log_name="overlap-workers")
    yield stack
    stack.stop()


@pytest.fixture
def on(stack_on: Stack) -> Stack:
    yield stack_on
    stack_on.check_kv_conservation()


def chat(stack: Stack, question: str, stream: bool = False, max_tokens: int = 12):
    """One chat on a fresh connection (so that the kernel may pick either gateway worker); a stream
    comes back as its list of chunks."""
    client = openai.OpenAI(
        base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0, http_client=httpx.Client()
    )
    with client:
        resp = client.chat.completions.create(
            model=SERVED_MODEL,
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=max_tokens,
            stream=stream,
        )
        return list(resp) if stream else resp


def test_greedy_chats_with_overlap_match_the_reference(on) -> None:
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(lambda q: chat(on, q), QUESTIONS))
    for question, resp in zip(QUESTIONS, answers, strict=True):
        expected = hf_greedy(chat_ids([{"role": "user", "content": question}]), 12)
        assert resp.choices[0].message.content == hf_tokenizer().decode(expected, skip_special_tokens=True)
        assert resp.usage.completion_tokens == len(expected)


def test_stream_events_carry_up_to_three_tokens(on) -> None:
    question = QUESTIONS[3]
    expected = hf_greedy(chat_ids([{"role": "user", "content": question}]), 10)
    chunks = [c for c in chat(on, question, stream=True, max_tokens=10) if c.choices]
    texts = [c.choices[0].delta.content or "" for c in chunks[1:]]  # after the role chunk
    assert "".join(texts) == hf_tokenizer().decode(expected, skip_special_tokens=True)
    # the first token alone (TTFT), then three at a time; the finish may come with the last few
    assert len(chunks) - 1 <= 1 + -(-(len(expected) - 1) // 3) + 1


def test_both_gateway_workers_take_connections(on) -> None:
    workers = set()
    for _ in range(40):
        text = httpx.get(f"{on.base_url}/metrics", timeout=10).text
        workers |= {
            line.split('worker="')[1].split('"')[0]
            for line in text.splitlines()
            if line.startswith("pdserve:gateway_in_flight_requests") and 'role="gateway"' in line
        }
        if len(workers) == 2:
            break
    assert len(workers) == 2, workers
