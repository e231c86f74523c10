"""Pydantic models of the native endpoints: SGLang-style /generate, vLLM-style /tokenize and /detokenize.

``GenerateOptions`` (with its ``NativeSamplingParams``) also validates the public gRPC API's
``GenerateRequest`` options (same field names).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve.constrained import GRAMMAR_KINDS
from pdserve.sampling.bounds import (
    FLOAT32_MAX,
    INT32_MAX,
    MAX_N,
    MAX_PRIORITY,
    MAX_RID_CHARS,
    MAX_SPECULATIVE_DRAFT_TOKENS,
    MAX_TOP_LOGPROBS,
)
from pdserve.services.gateway.io_struct import SamplingParams
from pdserve.services.gateway.openai.protocol import ChatMessage
from pdserve.services.gateway.openai.protocol_fields import (
    LogitBias,
    PositiveFloat32,
    RequestModel,
    Seed,
    Stop,
    StopTokenIds,
    TokenCount,
    TokenId,
    TopK,
    check_stop,
    param_error,
)
from pdserve.services.gateway.openai.structured_outputs import GrammarText

MAX_DETOKENIZE_IDS = 1 << 20  # /detokenize: a million ids, more than any context holds


class NativeSamplingParams(RequestModel):
    """``sampling_params`` of /generate; names and meaning as in ``pdserve.v1.SamplingParams``.

    Float fields must be finite (NaN and inf are rejected). At most one of ``json_schema`` (JSON
    text), ``regex``, ``ebnf`` and ``structural_tag`` holds the output to a grammar (SGLang's names).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    temperature: float | None = Field(None, ge=0.0, le=FLOAT32_MAX)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: TopK | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: PositiveFloat32 | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    max_new_tokens: TokenCount | None = None
    min_new_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: StopTokenIds = Field(default_factory=list)
    stop: Stop = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False  # SGLang's name for include_stop_str_in_output
    seed: Seed | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    n: int = Field(1, ge=1, le=MAX_N)
    logit_bias: LogitBias = Field(default_factory=dict)
    # constrained decoding (SGLang's names): at most one, as text (a schema as JSON text)
    json_schema: str | None = GrammarText
    regex: str | None = GrammarText
    ebnf: str | None = GrammarText
    structural_tag: str | None = GrammarText
    # speculative decoding: the most drafts verified per step (0 opts out; unset: the server's)
    speculative_num_draft_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_DRAFT_TOKENS)
    # vLLM's prompt logprobs: each prompt token's logprob (but the first's) and this many top ones,
    # answered in meta_info as SGLang's input_token_logprobs / input_top_logprobs
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("stop")
    @classmethod
    def _stop_within_bounds(cls, v: str | list[str]) -> str | list[str]:
        return check_stop(v, "sampling_params.stop")

    @model_validator(mode="after")
    def _check(self):
        if self.max_new_tokens is not None and (self.min_new_tokens or 0) > self.max_new_tokens:
            raise param_error(
                "sampling_params.min_new_tokens",
                f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})",
            )
        grammars = [kind for kind in GRAMMAR_KINDS if getattr(self, kind)]
        if len(grammars) > 1:
            raise param_error(f"sampling_params.{grammars[1]}", f"give at most one of {', '.join(grammars)}")
        if grammars and self.ignore_eos:
            raise param_error(
                "sampling_params.ignore_eos", f"'ignore_eos' cannot be combined with {grammars[0]}"
            )
        return self

    def to_sampling_params(
        self, return_logprob: bool, top_logprobs_num: int, priority: int
    ) -> SamplingParams:
        fields = self.model_dump(exclude={"n", "stop", "include_stop_str_in_output", "no_stop_trim"})
        return SamplingParams(
            **fields,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop),
            include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            priority=priority,
        )


class GenerateOptions(RequestModel):
    """Everything but the prompt that /generate and the gRPC API's ``GenerateRequest`` share.

    The gRPC servicer validates its request's options through this model, so both check them
    alike; ``top_logprobs_num`` > 0 needs ``return_logprob`` (it would be ignored otherwise).
    ``priority`` is vLLM's and SGLang's (lower is served first; not 0 only under
    ``--schedule-policy priority``, which the scheduler checks: a 400 otherwise).
    """

    model_config = ConfigDict(extra="forbid")

    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    rid: str | None = Field(None, min_length=1, max_length=MAX_RID_CHARS)
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    model: str | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprob(self):
        if self.top_logprobs_num and not self.return_logprob:
            raise param_error("top_logprobs_num", "'top_logprobs_num' requires 'return_logprob' to be true")
        return self

    def engine_sampling_params(self) -> SamplingParams:
        """The runtime's sampling parameters of this request (``max_new_tokens`` None = default)."""
        return self.sampling_params.to_sampling_params(
            self.return_logprob, self.top_logprobs_num, self.priority
        )


class NativeGenerateRequest(GenerateOptions):
    """POST /generate: exactly one of ``text`` / ``input_ids``, each one prompt or a batch (a list of
    them, as SGLang takes); a batch or n > 1 answers a list (or indexed chunks), choice ``j * n + i``
    being sample i of prompt j."""

    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    stream: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.text is None) == (self.input_ids is None):
            raise param_error("text", "give exactly one of 'text' and 'input_ids'")
        name = "text" if self.text is not None else "input_ids"
        if not (self.text or self.input_ids):
            raise param_error(name, f"'{name}' must not be empty")
        for i, prompt in enumerate(self.prompts):
            if not prompt:
                raise param_error(f"{name}.{i}", f"prompt {i} of the '{name}' batch is empty")
        return self

    @property
    def is_batch(self) -> bool:
        """Whether ``text`` / ``input_ids`` is a list of prompts (even of one)."""
        return isinstance(self.text, list) or bool(self.input_ids and isinstance(self.input_ids[0], list))

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per batch entry."""
        if not self.is_batch:
            return [self.text if self.text is not None else self.input_ids]
        return list(self.text if self.text is not None else self.input_ids)


class FinishReasonInfo(BaseModel):
    type: str
    matched: str | int | None = None


class MetaInfo(BaseModel):
    id: str
    finish_reason: FinishReasonInfo | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    e2e_latency: float | None = None
    # [logprob, token_id, None] per output token, as SGLang returns it.
    output_token_logprobs: list[tuple[float, int, None]] | None = None
    output_top_logprobs: list[list[tuple[float, int, None]]] | None = None
    # with sampling_params.prompt_logprobs: [logprob, token_id, None] per prompt token (the first's
    # logprob null), and the top ones of each (the first null), as SGLang's input logprobs
    input_token_logprobs: list[tuple[float | None, int, None]] | None = None
    input_top_logprobs: list[list[tuple[float, int, None]] | None] | None = None


class NativeGenerateResponse(BaseModel):
    """One choice of /generate; streamed chunks carry the text and ids so far (SGLang's default)."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int = 0


class TokenizeRequest(RequestModel):
    """POST /tokenize: ``prompt`` (plain text) or ``messages`` (rendered with the chat template)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise param_error("prompt", "give exactly one of 'prompt' and 'messages'")
        return self


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(RequestModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZE_IDS)
    skip_special_tokens: bool = True


class DetokenizeResponse(BaseModel):
    prompt: str
