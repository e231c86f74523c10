"""Fixtures shared with the tokenization tests (the real default-model tokenizer)."""

from tests.tokenization.conftest import tokenizer

__all__ = ["tokenizer"]
