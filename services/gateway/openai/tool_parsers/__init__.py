"""Tool-call formats: parse a model's calls out of its text (whole or streamed) and write the
grammar that forces calls (``tool_choice`` "required" or a named function).

The model's chat template implies one (``pdserve.tokenization.chat_formats``); ``--tool-call-parser``
overrides it: ``hermes`` (alias ``qwen``), ``llama3``, ``mistral``.
"""

from __future__ import annotations

from pdserve.services.gateway.openai.tool_parsers.base import ParsedOutput, Tool, ToolCall, ToolParser
from pdserve.services.gateway.openai.tool_parsers.hermes import HermesParser
from pdserve.services.gateway.openai.tool_parsers.llama3 import Llama3Parser
from pdserve.services.gateway.openai.tool_parsers.mistral import MistralParser
from pdserve.services.gateway.openai.tool_parsers.streaming import ToolCallDelta, ToolCallStream

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
}

__all__ = [
    "TOOL_PARSERS",
    "HermesParser",
    "ParsedOutput",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
]
