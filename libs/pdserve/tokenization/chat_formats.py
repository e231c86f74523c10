"""The tool-call and reasoning formats a model's chat template (or its vocabulary) implies.

As Ollama reads a model's tool format from its template, the tokenizer reads it here, and the
gateway parses chat outputs with the parsers these names stand for (vLLM's and SGLang's names;
``--tool-call-parser`` and ``--reasoning-parser`` override them):

- tool calls: a template that does not render ``tools`` at all (SmolLM2's) gets them through the
  default rendering (``default_tools``), whose format is ``hermes``. Otherwise ``hermes`` where the
  template writes ``<tool_call>``, ``mistral`` where it writes ``[TOOL_CALLS]``, ``llama3`` where it
  writes ``<|python_tag|>``; failing those, the same markers among the tokenizer's added tokens;
  failing those, the template shows tools in a format not recognised here: ``""`` (unknown).
- reasoning: ``deepseek_r1`` where the generation prompt opens a ``<think>`` block (the output
  starts inside it); ``qwen3`` where the template mentions ``<think>`` or the vocabulary has
  ``<think>`` and ``</think>`` tokens (the output reasons when it begins with ``<think>``); else ``""``.
"""

from __future__ import annotations

import re

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers import PreTrainedTokenizerBase

# marker -> format, in the order they are looked for
TOOL_CALL_MARKERS = {"<tool_call>": "hermes", "[TOOL_CALLS]": "mistral", "<|python_tag|>": "llama3"}
DEFAULT_TOOL_CALL_FORMAT = "hermes"  # what default_tools renders
THINK_START, THINK_END = "<think>", "</think>"


def chat_template_text(hf: PreTrainedTokenizerBase) -> str:
    """The template ``apply_chat_template`` uses for a request with tools ("" when there is none)."""
    try:
        return hf.get_chat_template(tools=[])
    except ValueError:  # no chat template
        return ""


def renders_tools(template: str) -> bool:
    """Whether ``template`` reads the ``tools`` variable (a template that does not gets the default
    rendering). A template that does not parse here (a transformers-only tag) is read as text."""
    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateError:
        return re.search(r"\btools\b", template) is not None


def tool_call_format(hf: PreTrainedTokenizerBase) -> str:
    """The tool-call format of ``hf``'s template (see the module docstring); "" when unknown."""
    template = chat_template_text(hf)
    if not renders_tools(template):
        return DEFAULT_TOOL_CALL_FORMAT
    added = {token.content for token in hf.added_tokens_decoder.values()}
    for found_in in (template, added):
        for marker, name in TOOL_CALL_MARKERS.items():
            if marker in found_in:
                return name
    return ""


def reasoning_format(hf: PreTrainedTokenizerBase, think_tokens: bool) -> str:
    """The reasoning convention of ``hf``'s template (see the module docstring); "" when none."""
    template = chat_template_text(hf)
    prompt = _generation_prompt(hf)
    if prompt.rfind(THINK_START) > prompt.rfind(THINK_END):
        return "deepseek_r1"
    return "qwen3" if THINK_START in template or think_tokens else ""


def _generation_prompt(hf: PreTrainedTokenizerBase) -> str:
    """What the template adds for ``add_generation_prompt`` after a one-message chat ("" when the
    template cannot render one)."""
    chat = [{"role": "user", "content": "?"}]
    try:
        bare = hf.apply_chat_template(chat, tokenize=False)
        prompted = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError):
        return ""
    return prompted.removeprefix(bare) if isinstance(prompted, str) and isinstance(bare, str) else ""
