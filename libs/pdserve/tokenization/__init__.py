"""Tokenizer and chat template of a model: text and chat messages to token ids, and back."""

from pdserve.tokenization.chat_template import ChatMessage, ChatPrompt, ChatTemplateError
from pdserve.tokenization.info import TokenizerInfo
from pdserve.tokenization.tokenizer import PromptTooLongError, Tokenizer

__all__ = [
    "ChatMessage",
    "ChatPrompt",
    "ChatTemplateError",
    "PromptTooLongError",
    "Tokenizer",
    "TokenizerInfo",
]
