"""Issue 7 through the whole stack: stop strings are matched on text, trimmed, and end the request."""

from __future__ import annotations

import openai
import pytest

from tests.reference import chat_ids, hf_greedy, hf_tokenizer

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference() -> str:
    """The greedy answer without stop strings, from Hugging Face transformers."""
    return hf_tokenizer().decode(hf_greedy(chat_ids(MESSAGES), MAX_TOKENS), skip_special_tokens=True)


def ask(stack, stop, stream: bool = False, **extra):
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none")
    kwargs = dict(
        model="SmolLM2-135M-Instruct", messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS, stop=stop
    )
    if extra:
        kwargs["extra_body"] = extra
    if not stream:
        resp = client.chat.completions.create(**kwargs)
        return [resp.choices[0].message.content], resp.choices[0].finish_reason, resp.usage
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return deltas, finish[-1], None


def finished_by(stack) -> dict[str, float]:
    """The schedulers' ``pdserve:requests_finished_total`` per finish reason (every worker summed)."""
    counts = stack.metrics(by=("finish_reason",)).get("pdserve:requests_finished_total", {})
    return {reason: value for (reason,), value in counts.items()}


def first_stop(text: str, stops: list[str]) -> int:
    return min(text.index(s) for s in stops if s in text)


def test_stop_string_spanning_three_tokens(stack, reference):
    tok = hf_tokenizer()
    stop = " of France is"
    assert stop in reference
    assert len(tok(stop, add_special_tokens=False)["input_ids"]) == 3
    before = finished_by(stack)
    (text,), finish, usage = ask(stack, [stop])
    assert text == reference[: reference.index(stop)]
    assert finish == "stop"
    assert usage.completion_tokens < len(tok(reference, add_special_tokens=False)["input_ids"])
    stack.wait_idle()  # the detokenizer's Abort(finish_reason=STOP) has reached the scheduler
    after = finished_by(stack)
    # the scheduler counts it as a stop, as the client saw it, not as an abort
    assert after.get("stop", 0) - before.get("stop", 0) == 1
    assert after.get("abort", 0) == before.get("abort", 0)


def test_later_listed_stop_that_matches_first_wins(stack, reference):
    stops = ["Paris", "capital"]
    (text,), finish, _ = ask(stack, stops)
    assert text == reference[: first_stop(reference, stops)] == reference[: reference.index("capital")]
    assert finish == "stop"


def test_stop_in_the_very_first_token(stack, reference):
    first_word = reference.split()[0]
    (text,), finish, _ = ask(stack, [first_word])
    assert text == "" and finish == "stop"


def test_streaming_never_sends_a_character_of_the_stop_string(stack, reference):
    stop = " France"
    deltas, finish, _ = ask(stack, [stop], stream=True)
    assert "".join(deltas) == reference[: reference.index(stop)]
    assert not any("F" in d for d in deltas)
    assert finish == "stop"


def test_include_stop_str_in_output(stack, reference):
    stop = " France"
    (text,), _, _ = ask(stack, [stop], include_stop_str_in_output=True)
    assert text == reference[: reference.index(stop) + len(stop)]


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_back_stop_strings(stack, stream):
    """A stop string counts only if it ends in the text of the min_tokens-th token or a later one."""
    min_tokens = 21
    tok = hf_tokenizer()
    ids = hf_greedy(chat_ids(MESSAGES), MAX_TOKENS, min_new_tokens=min_tokens)
    text = tok.decode(ids, skip_special_tokens=True)
    early = tok.decode(ids[: min_tokens - 1], skip_special_tokens=True)  # no stop may end in it
    straddling = tok.decode(ids[min_tokens - 2 : min_tokens])  # ends with the min_tokens-th token
    start = text.index(straddling)
    assert text.startswith(early) and start < len(early) < start + len(straddling)
    for stop in ["Paris", ","]:  # they occur, but end only in the text of the first min_tokens - 1
        assert stop in early and text.rfind(stop) + len(stop) <= len(early)
    chunks, finish, usage = ask(stack, ["Paris", ",", straddling], stream, min_tokens=min_tokens)
    assert "".join(chunks) == text[:start]
    assert finish == "stop"
    if usage is not None:
        assert usage.completion_tokens >= min_tokens
