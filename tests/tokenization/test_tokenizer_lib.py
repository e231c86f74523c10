"""pdserve.tokenization against transformers on the real SmolLM2 tokenizer and checkpoints built from it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from pdserve.model_source import resolve_model
from pdserve.tokenization import ChatMessage, ChatTemplateError, PromptTooLongError, Tokenizer

CONVERSATION = [
    ChatMessage("system", "You answer in one word."),
    ChatMessage("user", "Capital of France?"),
    ChatMessage("assistant", "Paris."),
    ChatMessage("user", "And of Italy? 你好 😀"),
]

TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name %}({{ m.name }}){% endif %}\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if think %}<think>{% endif %}{% endif %}"
)
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def as_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} | ({"name": m.name} if m.name else {}) for m in messages]


def hf_chat_ids(hf, messages: list[ChatMessage], **kwargs) -> list[int]:
    out = hf.apply_chat_template(as_dicts(messages), tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def custom_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default checkpoint's config and tokenizer with a tools-aware template and extra EOS ids."""
    src = resolve_model()
    dst = tmp_path_factory.mktemp("ckpt")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    (dst / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return dst


def test_encode_decode_match_transformers(tokenizer: Tokenizer) -> None:
    text = "Hello world! 你好，世界 😀 naïve café\n\tcode: x = [1, 2]"
    assert tokenizer.encode(text) == tokenizer.hf.encode(text)
    assert tokenizer.encode_batch([text, "ab"], False) == [
        tokenizer.hf.encode(text, add_special_tokens=False),
        tokenizer.hf.encode("ab", add_special_tokens=False),
    ]
    ids = [1, *tokenizer.encode(text), 2]
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == tokenizer.hf.decode(
            ids, skip_special_tokens=skip
        )
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_decode_rejects_ids_out_of_range(tokenizer: Tokenizer) -> None:
    for bad in ([tokenizer.info.vocab_size], [5, -1]):
        with pytest.raises(ValueError, match="out of range"):
            tokenizer.decode(bad)


def test_chat_ids_equal_transformers(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert prompt.input_ids == hf_chat_ids(tokenizer.hf, CONVERSATION, add_generation_prompt=True)
    assert prompt.text == tokenizer.hf.apply_chat_template(
        as_dicts(CONVERSATION), tokenize=False, add_generation_prompt=True
    )
    assert prompt.text.startswith("<|im_start|>system\nYou answer in one word.<|im_end|>")


def test_continue_final_message_continues_assistant_text(tokenizer: Tokenizer) -> None:
    messages = [*CONVERSATION, ChatMessage("assistant", "The capital is R")]
    prompt = tokenizer.apply_chat_template(messages, continue_final_message=True)
    assert prompt.text.endswith("<|im_start|>assistant\nThe capital is R")
    assert prompt.input_ids == hf_chat_ids(tokenizer.hf, messages, continue_final_message=True)
    closed = tokenizer.apply_chat_template(messages)
    assert closed.text == prompt.text + "<|im_end|>\n"


def test_bad_chat_input_raises(tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="at least one message"):
        tokenizer.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="exclude each other"):
        tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="may not set tokenize"):
        tokenizer.apply_chat_template(CONVERSATION, template_kwargs={"tokenize": True})
    with pytest.raises(ChatTemplateError, match="assistant message last"):  # CONVERSATION ends with the user
        tokenizer.apply_chat_template(CONVERSATION, continue_final_message=True)
    deep: list = []
    for _ in range(2000):  # past the template engine's recursion: a clean error, not a RecursionError
        deep = [deep]
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        tokenizer.apply_chat_template(CONVERSATION, template_kwargs={"x": deep})


def test_token_pieces_are_each_tokens_real_bytes(tokenizer: Tokenizer) -> None:
    """The pieces of a text's ids join into the text's UTF-8 bytes (emoji and CJK split across
    byte-level tokens included); a partial character shows as \\xNN; the 49,152 are all distinct."""
    text = "Héllo 😀 你好世界, naïve café 🚀!"
    ids = tokenizer.hf.encode(text, add_special_tokens=False)
    pieces = tokenizer.token_pieces(ids)
    assert b"".join(p.data for p in pieces) == text.encode()
    assert any(b"\\x" in p.text.encode() for p in pieces)  # 😀 spans several tokens here
    for token_id, p in zip(ids, pieces, strict=True):
        if "\\x" not in p.text:  # a whole character: the tokenizer's own text for the token
            assert p.text == tokenizer.hf.decode([token_id])
    everything = tokenizer.token_pieces(range(tokenizer.info.vocab_size))
    assert len({p.text for p in everything}) == len({p.data for p in everything}) == tokenizer.info.vocab_size
    assert tokenizer.token_pieces([0])[0].text == tokenizer.hf.convert_ids_to_tokens(0)  # a special token
    with pytest.raises(ValueError, match="out of range"):
        tokenizer.token_pieces([tokenizer.info.vocab_size])


def test_tools_names_and_kwargs_reach_the_template(custom_checkpoint: Path) -> None:
    ours = Tokenizer.load(str(custom_checkpoint))
    hf = AutoTokenizer.from_pretrained(custom_checkpoint)
    messages = [ChatMessage("user", "Weather in Paris?", name="alice")]
    prompt = ours.apply_chat_template(
        messages, add_generation_prompt=True, tools=[WEATHER_TOOL], template_kwargs={"think": True}
    )
    expected = hf.apply_chat_template(
        as_dicts(messages), tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False, think=True
    )
    assert prompt.text == expected
    assert prompt.text.startswith("TOOLS:get_weather;<|im_start|>user(alice)")
    assert prompt.text.endswith("<|im_start|>assistant\n<think>")
    assert prompt.input_ids == hf.encode(expected, add_special_tokens=False)


def test_info_reads_config_and_generation_config(tokenizer: Tokenizer, custom_checkpoint: Path) -> None:
    config = AutoConfig.from_pretrained(resolve_model())
    info = tokenizer.info
    assert info.model_name == "SmolLM2-135M-Instruct"
    assert info.vocab_size == len(tokenizer.hf)
    assert info.context_length == config.max_position_embeddings
    assert info.eos_token_ids == [tokenizer.hf.eos_token_id]
    custom = Tokenizer.load(str(custom_checkpoint)).info
    assert custom.model_name == custom_checkpoint.name
    generation = json.loads((custom_checkpoint / "generation_config.json").read_text())["eos_token_id"]
    assert set(custom.eos_token_ids) == {tokenizer.hf.eos_token_id, config.eos_token_id, *generation}
    assert len(custom.eos_token_ids) == len(set(custom.eos_token_ids))


def test_text_too_long_for_the_context_is_refused_before_encoding(tokenizer: Tokenizer) -> None:
    # every token stands for at most as many characters as its own string: a text more than
    # (longest token string) x (context length) characters long cannot fit; the bound is twice that
    longest = max(len(token) for token in tokenizer.hf.get_vocab())
    context = AutoConfig.from_pretrained(resolve_model()).max_position_embeddings
    assert tokenizer.max_text_chars == 2 * longest * context
    too_long = "a" * (tokenizer.max_text_chars + 1)
    with pytest.raises(PromptTooLongError, match=f"{len(too_long)} characters .* {context} tokens"):
        tokenizer.encode(too_long)
    with pytest.raises(PromptTooLongError):
        tokenizer.encode_batch(["fine", too_long])
    with pytest.raises(PromptTooLongError):
        tokenizer.apply_chat_template([ChatMessage("user", too_long)])
    tokenizer.check_length("a" * tokenizer.max_text_chars)  # at the bound: encoded, left to the context check
