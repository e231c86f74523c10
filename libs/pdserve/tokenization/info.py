"""What the rest of the system needs to know about a tokenizer: vocab size, EOS ids, context length,
whether it has reasoning tokens, the tool-call and reasoning formats of its chat template."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerBase

from pdserve.model_source import capped_context_length
from pdserve.tokenization.chat_formats import reasoning_format, tool_call_format


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    """Summary of a loaded tokenizer and its checkpoint.

    Attributes:
        model_name: the served model name.
        vocab_size: number of ids the tokenizer knows (``len(tokenizer)``, added tokens included).
        eos_token_ids: every id that ends generation: the tokenizer's EOS, then those of
            generation_config.json and config.json (deduplicated, in that order).
        context_length: ``max_position_embeddings`` of config.json (0 when absent), capped at
            ``--max-model-len``.
        think_tokens: ``<think>`` and ``</think>`` are tokens of their own in the vocabulary, as in
            reasoning models (Qwen3, DeepSeek-R1): the model may open a reasoning block.
        tool_call_parser: the tool-call format the chat template implies (``chat_formats``:
            ``hermes``, ``llama3``, ``mistral``; "" when not recognised).
        reasoning_parser: the reasoning convention it implies (``deepseek_r1``, ``qwen3``; "" none).
    """

    model_name: str
    vocab_size: int
    eos_token_ids: list[int]
    context_length: int
    think_tokens: bool = False
    tool_call_parser: str = ""
    reasoning_parser: str = ""


def read_tokenizer_info(
    hf: PreTrainedTokenizerBase, checkpoint: Path, model_name: str, max_model_len: int | None = None
) -> TokenizerInfo:
    """Build the ``TokenizerInfo`` of ``hf`` loaded from the checkpoint directory ``checkpoint``.

    Raises:
        ValueError: ``max_model_len`` exceeds the model's context.
    """
    config = AutoConfig.from_pretrained(checkpoint)
    text_config = config.get_text_config()
    try:
        generation_eos = GenerationConfig.from_pretrained(checkpoint).eos_token_id
    except OSError:  # no generation_config.json
        generation_eos = None
    eos: list[int] = []
    for value in (hf.eos_token_id, generation_eos, text_config.eos_token_id):
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and token_id not in eos:
                eos.append(int(token_id))
    think_tokens = {"<think>", "</think>"} <= hf.get_vocab().keys()
    return TokenizerInfo(
        model_name=model_name,
        vocab_size=len(hf),
        eos_token_ids=eos,
        context_length=capped_context_length(
            int(getattr(text_config, "max_position_embeddings", 0) or 0), max_model_len
        ),
        think_tokens=think_tokens,
        tool_call_parser=tool_call_format(hf),
        reasoning_parser=reasoning_format(hf, think_tokens),
    )
