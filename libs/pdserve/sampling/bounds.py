"""The bounds of every request field, in one table for every place a request enters.

The gateway's HTTP models (pydantic ``Field`` bounds built from these numbers), its public gRPC API
(validated by the same models) and ``Scheduler.add_request`` (internal ports are reachable too) all
read them, so what one entry refuses, every entry refuses, and nothing out of range reaches a
forward step, where one bad value would fail every request of the batch.

- Integers stay within their wire types: token ids, ``top_k`` and token counts are int32, seeds
  int64; float fields are finite and within float32 (what protobuf carries).
- ``top_k`` is -1 or 0 (disabled) or in [1, vocab]; token ids (prompt, ``stop_token_ids``,
  ``logit_bias`` keys, /detokenize) are in [0, vocab).
- ``speculative_num_draft_tokens`` (a request's cap on its drafts per step) is in [0, 16]: a verify
  step computes ``1 + k`` tokens for the request.
- ``priority`` (vLLM's: lower is served first) is in [-1000, 1000], and not 0 only under
  ``--schedule-policy priority`` (``Scheduler.add_request`` refuses it otherwise, as vLLM does).
- ``lora_name`` (the LoRA adapter a request runs under) has at most 128 characters, and names an
  adapter the worker serves (``Scheduler.add_request``).
- ``n`` <= 128 and ``top_logprobs`` <= 20 are OpenAI's limits (``prompt_logprobs`` too, on a
  prompt of at most 4,096 tokens); ``logit_bias`` values are in
  [-100, 100] (OpenAI's range).
- Counts no real client reaches, which bound one request's work per step: at most 64 stop strings
  of at most 256 characters each and 1,024 in all (the detokenizer searches every stop string in
  each step's new text and checks which tail of the text may start one: the bound keeps that to
  well under a millisecond per request and step, see ``benchmarks/detokenizer.py``); at most 1,024
  ``stop_token_ids`` (checked per generated token); at most 1,024 ``logit_bias`` entries (written
  into the batch's bias row each step).
- Grammars (constrained decoding): at most one of ``json_schema``, ``regex``, ``ebnf``,
  ``structural_tag``, never with ``ignore_eos``. A client's grammar text (each of those, a
  ``response_format`` schema as JSON text, a tool's parameter schema) holds at most 64 KiB
  characters; a scheduler takes up to 256 KiB, the gateway's own tool-call and reasoning wrappers
  around the client's schemas included (xgrammar compiles on a worker thread, cached, within the
  scheduler's compile timeout). At most 128 tools (OpenAI's limit), 256 KiB characters of them in
  all as JSON; vLLM's ``choice``: at most 256 choices of 1 to 1,024 characters.
- Free-form JSON the chat template renders (``tools``, ``chat_template_kwargs``) nests at most 64
  levels (the template engine recurses per level: a few hundred exhaust Python's stack), and
  ``chat_template_kwargs`` holds at most 64 KiB characters as JSON.
- A temperature below ``GREEDY_TEMPERATURE`` (1e-5, vLLM's ``_SAMPLING_EPS``) is greedy: dividing
  the logits by a near-zero temperature overflows them to inf, and softmax of that is NaN.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The largest float32 as its shortest decimal (what protobuf's JSON form writes): every double up to
# it rounds to a finite float32.
FLOAT32_MAX = 3.4028235e38

MAX_RID_CHARS = 256  # a client's rid (X-Request-Id, native /generate and gRPC rid)
# a scheduler's rid: a client's with the gateway's -{index}.{tag} (internal callers are bounded too)
MAX_SCHEDULER_RID_CHARS = 512
MAX_N = 128
MAX_SPECULATIVE_DRAFT_TOKENS = 16  # draft tokens a request verifies per step (speculative decoding)
MAX_TOP_LOGPROBS = 20
# prompt logprobs (echo + logprobs, prompt_logprobs): a prompt of at most this many tokens (each
# position returns up to MAX_TOP_LOGPROBS + 1 entries, computed as [chunk, vocab] float32 logits)
MAX_PROMPT_LOGPROB_TOKENS = 4096
# ... and at most this many scored positions in one response (prompt tokens x n over its prompts:
# every choice carries its prompt's logprobs, built and serialised on the gateway's event loop)
MAX_PROMPT_LOGPROB_POSITIONS = 2 * MAX_PROMPT_LOGPROB_TOKENS
MAX_EMBEDDING_INPUTS = 256  # inputs of one /v1/embeddings request (OpenAI allows 2048)
MAX_LOGIT_BIAS = 100.0
MAX_LORA_NAME_CHARS = 128  # a LoRA adapter's name (the request's ``model``)
MAX_LORA_PATH_CHARS = 4096  # a LoRA adapter's directory (``/v1/load_lora_adapter``'s ``lora_path``)
MAX_PRIORITY = 1000  # a request's priority is in [-MAX_PRIORITY, MAX_PRIORITY] (lower is served first)
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOTAL_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
GREEDY_TEMPERATURE = 1e-5
MAX_GRAMMAR_CHARS = 64 * 1024  # what a client sends as one grammar text
MAX_SCHEDULER_GRAMMAR_CHARS = 256 * 1024  # what a scheduler compiles (gateway wrappers included)
MAX_TOOLS = 128
MAX_TOOLS_CHARS = 256 * 1024
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
MAX_JSON_DEPTH = 64
MAX_TEMPLATE_KWARGS_CHARS = 64 * 1024


class BoundError(ValueError):
    """A request field out of its bounds.

    Attributes:
        field: the field's name as ``SamplingParams`` names it (``top_k``, ``stop``, ...); the message
            starts with it.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field


def check_stop_strings(stop: Sequence[str]) -> None:
    """Raise ``BoundError`` (field ``stop``) unless ``stop`` holds at most ``MAX_STOP_STRINGS``
    non-empty strings of at most ``MAX_STOP_STRING_CHARS`` characters, ``MAX_STOP_TOTAL_CHARS`` in all."""
    if len(stop) > MAX_STOP_STRINGS:
        raise BoundError("stop", f"has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise BoundError("stop", f"strings must be non-empty text, got {s!r}")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise BoundError("stop", f"string of {len(s)} characters is longer than {MAX_STOP_STRING_CHARS}")
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_TOTAL_CHARS:
        raise BoundError("stop", f"strings have {total} characters in all; at most {MAX_STOP_TOTAL_CHARS}")


def check_vocab_fields(
    top_k: int | None, stop_token_ids: Sequence[int], logit_bias_ids: Iterable[int], vocab_size: int
) -> None:
    """Raise ``BoundError`` naming the field unless ``top_k`` is None, -1, 0 or in [1, vocab_size]
    and every id of ``stop_token_ids`` and ``logit_bias_ids`` is in [0, vocab_size)."""
    if top_k is not None and not (-1 <= top_k <= vocab_size):
        raise BoundError(
            "top_k", f"must be -1 or 0 (disabled) or in [1, {vocab_size}] (the vocabulary), got {top_k}"
        )
    bias_ids = list(logit_bias_ids)
    for name, ids, most in (
        ("stop_token_ids", stop_token_ids, MAX_STOP_TOKEN_IDS),
        ("logit_bias", bias_ids, MAX_LOGIT_BIAS_ENTRIES),
    ):
        if len(ids) > most:
            raise BoundError(name, f"has {len(ids)} entries; at most {most} are allowed")
        bad = next((i for i in ids if not (isinstance(i, int) and 0 <= i < vocab_size)), None)
        if bad is not None:
            raise BoundError(name, f"names token id {bad}, outside the vocabulary [0, {vocab_size})")


def check_grammars(texts: Mapping[str, str | None], ignore_eos: bool) -> None:
    """Raise ``BoundError`` naming the field unless at most one of ``texts`` (grammar kind -> text or
    None) is set, to 1 to ``MAX_SCHEDULER_GRAMMAR_CHARS`` characters, and ``ignore_eos`` is false
    where one is (the grammar decides where the output ends)."""
    given = [kind for kind, text in texts.items() if text is not None]
    if len(given) > 1:
        raise BoundError(given[1], f"cannot be combined with {given[0]}: at most one of {', '.join(texts)}")
    if not given:
        return
    kind, text = given[0], texts[given[0]]
    if ignore_eos:
        raise BoundError("ignore_eos", f"cannot be combined with {kind}: the grammar decides the end")
    if not text:
        raise BoundError(kind, "must not be empty")
    if len(text) > MAX_SCHEDULER_GRAMMAR_CHARS:
        raise BoundError(kind, f"has {len(text)} characters; at most {MAX_SCHEDULER_GRAMMAR_CHARS}")


def wrap_int64(value: int) -> int:
    """``value`` wrapped into int64 (two's complement): the seed of sample i is ``seed + i``, which
    must stay a valid int64 even for a seed next to the limit."""
    return (value - INT64_MIN) % 2**64 + INT64_MIN


def json_depth(value: object) -> int:
    """How deep a parsed JSON value nests: 0 for a scalar, 1 for ``[]`` or ``{"a": 1}``, 2 for
    ``[[1]]``; walked level by level, without recursion, so any depth is measured."""
    depth, level = 0, [value]
    while containers := [v for v in level if isinstance(v, dict | list)]:
        depth += 1
        level = [child for v in containers for child in (v.values() if isinstance(v, dict) else v)]
    return depth
