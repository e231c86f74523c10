"""The gateway's transport-free request and output objects (SGLang's ``GenerateReqInput`` side).

The serving modules turn protocol objects (OpenAI JSON, native /generate JSON, the public gRPC
``GenerateRequest``) into a ``GenerateReqInput``; the ``RequestManager`` turns that into
``TokenizedGenerateReqInput`` messages for the decode-schedulers and hands back ``ChoiceDelta``
pieces built from the detokenizer's ``StrOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(slots=True)
class SamplingParams:
    """Sampling parameters of one request; field names and meaning follow ``pdserve.v1.SamplingParams``.

    ``None`` means "engine default". ``max_new_tokens`` is filled in by the ``RequestManager`` when
    the client gave none (context length minus prompt length, capped).
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    seed: int | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    prompt_logprobs: int | None = None  # None: none; else prompt tokens' logprobs with this many top
    logit_bias: dict[int, float] = field(default_factory=dict)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    speculative_num_draft_tokens: int | None = None
    priority: int = 0  # lower is served first (--schedule-policy priority)
    embed: bool = False  # return the prompt's embedding (``/v1/embeddings``; max_new_tokens 1)
    lora_name: str = ""  # the LoRA adapter the request's ``model`` names ("": the base model)


@dataclass(slots=True)
class ChatPrompt:
    """Chat messages to render with the model's chat template (done by the tokenizer service)."""

    messages: list[dict[str, str]]  # pdserve.v1.ChatMessage fields
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools_json: str = ""
    chat_template_kwargs_json: str = ""


Prompt = str | list[int] | ChatPrompt


@dataclass(slots=True)
class GenerateReqInput:
    """One client request: ``len(prompts) * n`` choices, choice ``j * n + i`` = prompt j, sample i.

    Sub-request rids are ``rid`` for a single choice and ``f"{rid}-{k}"`` (k = choice index)
    otherwise; with a seed, sample i of each prompt uses ``seed + i`` (wrapped into int64).
    ``params_path`` is where the sampling fields sit in the client's request (``"sampling_params."``
    for /generate and the gRPC API, ``""`` for OpenAI's flat bodies): errors name ``params_path +
    field``.
    """

    rid: str
    prompts: list[Prompt]
    sampling_params: SamplingParams
    n: int = 1
    add_special_tokens: bool = True
    params_path: str = ""

    @property
    def num_choices(self) -> int:
        """Sub-requests this request fans out into: prompts × n."""
        return len(self.prompts) * self.n


@dataclass(frozen=True, slots=True)
class TokenPiece:
    """One token alone: ``data`` its bytes, ``text`` them as text (a partial character as ``\\xNN``)."""

    text: str
    data: bytes


@dataclass(slots=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(slots=True)
class TokenLogprob:
    """Logprob (natural log) of one generated token and its top alternatives; a prompt token's also
    has its ``rank`` (1 + the tokens more likely than it; 0 = not computed)."""

    token_id: int
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)
    rank: int = 0


@dataclass(slots=True)
class ChoiceDelta:
    """One streamed piece of one choice (from one ``StrOutput``).

    ``text`` and ``token_ids`` are deltas; the token counts are totals so far. ``finish_reason`` is
    set on the last piece of a choice only; ``prompt_tokens`` is the gateway's own count of the ids
    it sent. ``prompt_logprobs`` (on a choice's first piece, when asked) score prompt tokens 1.. in
    order (token 0 has none); so does ``embedding`` (float32 ``[hidden]``, L2-normalised) where the
    request embeds its prompt.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    embedding: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    error: str = ""
    retryable: bool = False  # an "error" finish caused by the server's state: 503 + Retry-After
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    worker_lost: bool = False  # an "error" finish because its decode worker went away: migrate it


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What a scheduler reports in ``GetLoad``, as the gateway uses it.

    ``load``: its queued plus running requests; ``capacity``: the requests it takes before refusing
    (those it can run at once plus its waiting-queue bound; 0 = unbounded); ``max_queued``: its
    waiting-queue bound alone (0 = unbounded); ``incarnation``: changes when its process restarts;
    ``lora_resident``: the LoRA adapters in its slots.
    """

    load: int
    capacity: int
    incarnation: str
    max_queued: int = 0
    lora_resident: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the tokenizer service reports about the model (``Tokenizer.GetInfo``); ``think_tokens``:
    the vocabulary has ``<think>`` and ``</think>`` tokens (a reasoning model); ``tool_call_parser``
    and ``reasoning_parser``: the formats its chat template implies ("" none or not recognised)."""

    model_name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    context_length: int
    think_tokens: bool = False
    tool_call_parser: str = ""
    reasoning_parser: str = ""


@dataclass(slots=True)
class TokenizedPrompt:
    input_ids: list[int]
    prompt_text: str = ""
