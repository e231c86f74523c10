"""The gateway's chat-output flags, which ``pdserve launch`` takes too and passes on.

The names are those of the gateway's formats (``gateway.openai.tool_parsers.TOOL_PARSERS``,
``gateway.openai.reasoning_parser.ReasoningParser``), listed here so that the launcher checks a
name at once without importing the gateway.
"""

from __future__ import annotations

import argparse

TOOL_CALL_PARSERS = ("hermes", "llama3", "mistral", "qwen")
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def add_chat_parser_args(p: argparse.ArgumentParser) -> None:
    """``--tool-call-parser`` and ``--reasoning-parser`` (the gateway's; ``pdserve launch`` passes them)."""
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_CALL_PARSERS,
        help="tool-call format to parse from chat outputs (hermes = qwen: <tool_call>; llama3: JSON; "
        "mistral: [TOOL_CALLS]); default: the one the model's chat template implies (hermes for a "
        "template that does not render tools: the tokenizer shows them in that format)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="split <think>...</think> reasoning into reasoning_content (deepseek_r1: the output starts "
        "reasoning; qwen3: when it begins with <think>); default: the one the chat template implies",
    )
