"""Issue 19's edge parameters end to end (``stack``, real model): logprobs carry each token's real
bytes with distinct alternatives, ``continue_final_message`` needs an assistant message last, and a
near-zero temperature is greedy.

Expected tokens, logprobs and pieces come from HF transformers and the HF tokenizer in the test.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tests.reference import chat_ids, hf_greedy, hf_model, hf_tokenizer
from tests.stack import SERVED_MODEL, Stack

QUESTION = [{"role": "user", "content": "Reply with one emoji."}]
TOP = 5


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0)


def piece_bytes(token_id: int) -> bytes:
    """The byte-level BPE piece of ``token_id`` as bytes (GPT-2's byte-to-character table inverted)."""
    decoder = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(decoder[c] for c in hf_tokenizer().convert_ids_to_tokens(token_id))


def hf_top(ids: list[int], k: int) -> list[tuple[int, float]]:
    """HF's ``k`` most likely next tokens after ``ids`` with their logprobs (fp32)."""
    with torch.no_grad():
        logits = hf_model()(torch.tensor([ids])).logits[0, -1].float()
    values, indices = torch.log_softmax(logits, -1).topk(k)
    return list(zip(indices.tolist(), values.tolist(), strict=True))


def emoji_start() -> int:
    """A token that holds the first bytes of an emoji, and no whole character after its space."""
    (token,) = [t for t in hf_tokenizer().encode(" 😀") if piece_bytes(t).startswith(b" \xf0")]
    return token


def test_top_logprobs_of_partial_characters_are_distinct_with_their_bytes(stack) -> None:
    """The first token is forced (logit_bias) to an emoji's first bytes; the alternatives for the
    next one are single continuation bytes, which all decoded to U+FFFD before."""
    first = emoji_start()
    resp = client(stack).chat.completions.create(
        model=SERVED_MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=2,
        logprobs=True,
        top_logprobs=TOP,
        logit_bias={str(first): 100},
    )
    entries = resp.choices[0].logprobs.content
    assert bytes(entries[0].bytes) == piece_bytes(first)
    assert entries[0].token == piece_bytes(first).decode(errors="backslashreplace")
    expected = hf_top([*chat_ids(QUESTION), first], TOP)
    tops = entries[1].top_logprobs
    assert len(tops) == TOP and len({t.token for t in tops}) == TOP
    assert [bytes(t.bytes) for t in tops] == [piece_bytes(i) for i, _ in expected]
    assert [t.token for t in tops] == [piece_bytes(i).decode(errors="backslashreplace") for i, _ in expected]
    assert [t.logprob for t in tops] == pytest.approx([lp for _, lp in expected], abs=1e-3)
    assert any(b"\\x" in t.token.encode() for t in tops)

    # legacy completions: top_logprobs is a dict keyed by token text, so duplicates used to collapse
    prompt = [*chat_ids(QUESTION), first]
    comp = client(stack).completions.create(
        model=SERVED_MODEL, prompt=prompt, temperature=0, max_tokens=1, logprobs=TOP
    )
    top = comp.choices[0].logprobs.top_logprobs[0]
    assert list(top) == [piece_bytes(i).decode(errors="backslashreplace") for i, _ in expected]
    assert comp.choices[0].logprobs.tokens[0] == list(top)[0]


def test_legacy_logprobs_offsets_point_into_the_text_and_leave_the_stop_text_out(stack) -> None:
    """``text_offset`` counts characters of the text, a character split over byte-fallback tokens
    once (the offsets come from the HF pieces' bytes here); ``top_logprobs`` hold the chosen token
    beside the top N (OpenAI's N + 1); a matched stop string's tokens are not in ``tokens``."""
    prompt = hf_tokenizer()("Café ☕ 東京")["input_ids"]
    out = client(stack).completions.create(
        model=SERVED_MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1
    )
    lp, text = out.choices[0].logprobs, out.choices[0].text
    assert text == "Café ☕ 東京"
    data = [piece_bytes(t) for t in prompt]
    assert any(len(d.decode(errors="ignore")) < len(d.decode(errors="replace")) for d in data)  # split
    want = [len(b"".join(data[:i]).decode(errors="ignore")) for i in range(len(prompt))]
    assert lp.text_offset == want and max(want) < len(text)
    for pos in range(1, len(prompt)):
        assert lp.tokens[pos] in lp.top_logprobs[pos] and 1 <= len(lp.top_logprobs[pos]) <= 2

    out = client(stack).completions.create(
        model=SERVED_MODEL, prompt="Count: 1, 2,", max_tokens=8, temperature=0, stop=[","], logprobs=0
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.text.strip().isdigit(), choice
    assert "".join(choice.logprobs.tokens) == choice.text  # not the ',' it stopped at
    assert [list(top) for top in choice.logprobs.top_logprobs] == [[t] for t in choice.logprobs.tokens]


def test_a_streamed_stop_string_leaves_its_tokens_out_as_the_whole_answer_does(stack) -> None:
    """A stop string that starts inside a token and spans the next: the stream sends each token's
    logprobs with the text it starts in, so the stop text's tokens (whose text the detokenizer held
    back) never go out, and the stream's entries equal the whole answer's."""
    c = client(stack)
    args = {"model": SERVED_MODEL, "prompt": "Write a sentence about the sea", "max_tokens": 12}
    args |= {"temperature": 0, "logprobs": 1}
    free = c.completions.create(**args).choices[0].logprobs.tokens
    stop = free[2][-1:] + free[3] + free[4][:1]
    whole = c.completions.create(**args, stop=[stop]).choices[0]
    chunks = [ch.choices[0] for ch in c.completions.create(**args, stop=[stop], stream=True) if ch.choices]
    text = "".join(ch.text for ch in chunks)
    tokens = [t for ch in chunks if ch.logprobs for t in ch.logprobs.tokens]
    offsets = [o for ch in chunks if ch.logprobs for o in ch.logprobs.text_offset]
    assert whole.finish_reason == chunks[-1].finish_reason == "stop" and text == whole.text, (stop, text)
    assert tokens == whole.logprobs.tokens == free[:3] and offsets == whole.logprobs.text_offset
    assert max(offsets) < len(text)


def test_generate_return_logprob_without_top_logprobs_num(stack) -> None:
    """SGLang's /generate: ``return_logprob`` alone gives each output token's logprob, and no top ones."""
    prompt = hf_tokenizer()("The capital of France is")["input_ids"]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        "return_logprob": True,
    }
    out = httpx.post(f"{stack.base_url}/generate", json=body, timeout=120).json()
    meta = out["meta_info"]
    assert meta["output_top_logprobs"] is None
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"] == hf_greedy(prompt, 2)
    [(token, logprob)] = hf_top(prompt, 1)
    assert meta["output_token_logprobs"][0][:2] == [pytest.approx(logprob, abs=1e-3), token]


def test_continue_final_message_needs_an_assistant_message_last(stack) -> None:
    c = client(stack)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=SERVED_MODEL,
            messages=QUESTION,
            max_tokens=4,
            extra_body={"add_generation_prompt": False, "continue_final_message": True},
        )
    assert e.value.body["param"] == "continue_final_message"
    messages = [*QUESTION, {"role": "assistant", "content": "Sure, here it is:"}]
    resp = c.chat.completions.create(
        model=SERVED_MODEL,
        messages=messages,
        temperature=0,
        max_tokens=8,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    tok = hf_tokenizer()
    ids = tok.apply_chat_template(messages, continue_final_message=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert resp.choices[0].message.content == tok.decode(hf_greedy(ids, 8), skip_special_tokens=True)


@pytest.mark.parametrize("temperature", [1e-40, 1e-7])
def test_a_near_zero_temperature_is_greedy(stack, temperature) -> None:
    ids = chat_ids([{"role": "user", "content": "Write a haiku about autumn leaves."}])
    body = {"input_ids": ids, "sampling_params": {"temperature": temperature, "max_new_tokens": 16}}
    resp = httpx.post(f"{stack.base_url}/generate", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    assert resp.json()["output_ids"] == hf_greedy(ids, 16)
