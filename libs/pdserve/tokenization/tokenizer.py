"""The model's tokenizer: encode text, render chat, decode ids (one place that calls transformers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pdserve.model_source import resolve_model, served_model_name
from pdserve.tokenization.chat_formats import chat_template_text, renders_tools
from pdserve.tokenization.chat_template import ChatMessage, ChatPrompt, load_chat_template, render_chat
from pdserve.tokenization.default_tools import with_default_tools
from pdserve.tokenization.info import TokenizerInfo, read_tokenizer_info
from pdserve.tokenization.token_pieces import TokenPiece, TokenPieces


class PromptTooLongError(ValueError):
    """A prompt refused before encoding: it cannot fit the model's context."""


class Tokenizer:
    """A Hugging Face tokenizer plus the facts about its checkpoint that serving needs.

    Args:
        hf: the transformers tokenizer (``hf`` stays public for reference checks).
        checkpoint: the checkpoint directory it was loaded from (config.json lives there).
        model_name: the served model name reported by ``info``.
        max_model_len: caps ``info.context_length`` (``--max-model-len``).

    Thread safety: encode/decode may run from several threads at once (nothing here mutates the
    tokenizer after loading).
    """

    def __init__(
        self,
        hf: PreTrainedTokenizerBase,
        checkpoint: Path,
        model_name: str,
        max_model_len: int | None = None,
    ) -> None:
        self.hf = hf
        self.info: TokenizerInfo = read_tokenizer_info(hf, checkpoint, model_name, max_model_len)
        # a template that does not render tools gets them through the default rendering
        self.default_tools = not renders_tools(chat_template_text(hf))
        # A fast tokenizer whose decode adds no Python post-processing can decode a whole batch in
        # one Rust call; otherwise go through transformers (same text, slower).
        self._rust = hf.backend_tokenizer if hf.is_fast and not hf.clean_up_tokenization_spaces else None
        self._pieces = TokenPieces(hf)
        # A token stands for at most as many characters of text as its own string has (byte-level
        # BPE: one character per byte; SentencePiece: one per character), so a text longer than
        # this needs more tokens than the context holds; twice the bound leaves room for normalizers.
        longest = max(map(len, hf.get_vocab()), default=1)
        self.max_text_chars = 2 * longest * self.info.context_length

    def check_length(self, text: str) -> None:
        """Refuse, before encoding it, a text too long in characters to fit the context in tokens
        (encoding tens of megabytes would take the service's cores for seconds first).

        Raises:
            PromptTooLongError: ``text`` is longer than ``max_text_chars`` (context length known).
        """
        if self.max_text_chars and len(text) > self.max_text_chars:
            raise PromptTooLongError(
                f"prompt of {len(text)} characters is longer than the model's context of "
                f"{self.info.context_length} tokens can hold"
            )

    @classmethod
    def load(
        cls,
        model: str | None = None,
        *,
        revision: str | None = None,
        model_name: str | None = None,
        chat_template: str | None = None,
        max_model_len: int | None = None,
    ) -> Tokenizer:
        """Load the tokenizer of ``model`` (as ``pdserve.model_source.resolve_model`` takes it, with
        ``revision``), served as ``model_name`` (default: from ``model``), with ``chat_template``
        (a file or an inline Jinja template, ``load_chat_template``) instead of the model's own.

        Raises:
            FileNotFoundError: the model path does not exist.
            ValueError: a bad ``chat_template`` or a ``max_model_len`` beyond the model's context.
        """
        checkpoint = resolve_model(model, revision)
        hf = AutoTokenizer.from_pretrained(checkpoint)
        if chat_template is not None:
            hf.chat_template = load_chat_template(chat_template)
        return cls(hf, checkpoint, model_name or served_model_name(model), max_model_len)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer's post-processor adds.

        Raises:
            PromptTooLongError: see ``check_length``.
        """
        self.check_length(text)
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, encoded in one batched (Rust-parallel for fast tokenizers) call.

        Raises:
            PromptTooLongError: see ``check_length``.
        """
        if not texts:
            return []
        for text in texts:
            self.check_length(text)
        return self.hf(list(texts), add_special_tokens=add_special_tokens)["input_ids"]

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> ChatPrompt:
        """Render ``messages`` with the model's chat template and tokenize the result.

        The ids equal ``hf.apply_chat_template(..., tokenize=True)``: the rendered text is encoded
        without adding special tokens, because the template writes them itself. Where the template
        does not render tools (``default_tools``), the tools, the assistant turns' calls and the
        tool results are first written into the messages (``pdserve.tokenization.default_tools``).

        Raises:
            ChatTemplateError: see ``pdserve.tokenization.chat_template.render_chat``.
        """
        if self.default_tools:
            messages, tools = with_default_tools(messages, tools), None
        text = render_chat(
            self.hf,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            template_kwargs=template_kwargs,
        )
        return ChatPrompt(text=text, input_ids=self.encode(text, add_special_tokens=False))

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        """Text of ``ids``.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        self.check_ids(ids)
        return self.batch_decode([list(ids)], skip_special_tokens, spaces_between_special_tokens)[0]

    def batch_decode(
        self,
        sequences: list[list[int]],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> list[str]:
        """Text of each id sequence, as ``hf.decode`` gives it; ids are trusted (see ``check_ids``).

        ``spaces_between_special_tokens`` only changes the output of slow (Python) tokenizers, as in
        transformers itself.
        """
        if self._rust is not None:
            return self._rust.decode_batch(sequences, skip_special_tokens=skip_special_tokens)
        return [
            self.hf.decode(
                s,
                skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=spaces_between_special_tokens,
            )
            for s in sequences
        ]

    def token_pieces(self, ids: Sequence[int]) -> list[TokenPiece]:
        """The bytes and text of each token of ``ids`` alone (see ``token_pieces.TokenPieces``).

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        self.check_ids(ids)
        return [self._pieces.get(i) for i in ids]

    def check_ids(self, ids: Sequence[int]) -> None:
        """Raise ``ValueError`` unless every id is in ``[0, vocab_size)``."""
        bad = [i for i in ids if not 0 <= i < self.info.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.info.vocab_size}): {bad[:8]}")
