"""The gateway's chat-output flags, shared with ``pdserve launch`` (which passes them on)."""

from __future__ import annotations

import argparse

from pdserve.services.gateway.openai.reasoning_parser import REASONING_PARSERS
from pdserve.services.gateway.openai.tool_parsers import TOOL_PARSERS


def add_chat_parser_args(p: argparse.ArgumentParser) -> None:
    """``--tool-call-parser`` and ``--reasoning-parser`` (the gateway's; ``pdserve launch`` passes them)."""
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="tool-call format to parse from chat outputs (hermes = qwen: <tool_call>; llama3: JSON; "
        "mistral: [TOOL_CALLS]); without it, chat requests may only show tools (tool_choice 'none')",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="split <think>...</think> reasoning into reasoning_content (deepseek_r1: the output starts "
        "reasoning; qwen3: when it begins with <think>)",
    )
