"""Per-request sampling parameters (the OpenAI / SGLang set)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.constrained.spec import GRAMMAR_KINDS, GrammarSpec
from pdserve.sampling.bounds import (
    FLOAT32_MAX,
    GREEDY_TEMPERATURE,
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_LORA_NAME_CHARS,
    MAX_N,
    MAX_PRIORITY,
    MAX_SPECULATIVE_DRAFT_TOKENS,
    MAX_TOP_LOGPROBS,
    BoundError,
    check_grammars,
    check_stop_strings,
    check_vocab_fields,
)


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        temperature: softmax temperature; below 1e-5 (``GREEDY_TEMPERATURE``) means greedy (argmax).
        top_p: nucleus sampling (Holtzman et al. 2019): keep the most likely tokens whose mass
            reaches ``top_p``; 1 disables.
        top_k: keep the ``top_k`` most likely tokens; -1 or 0 disables; at most the vocabulary size.
        min_p: keep tokens with probability >= ``min_p`` × the top probability; 0 disables.
        repetition_penalty: CTRL-style (Keskar et al. 2019) penalty over prompt and output tokens:
            positive logits are divided by it, negative ones multiplied; 1 disables.
        frequency_penalty: subtracted from a token's logit once per occurrence in the output
            (OpenAI semantics), in [-2, 2].
        presence_penalty: subtracted once from the logit of every token present in the output, in [-2, 2].
        max_new_tokens: most tokens to generate (>= 1).
        min_new_tokens: EOS and ``stop_token_ids`` are masked until this many tokens were generated.
        ignore_eos: do not stop at the model's EOS tokens.
        stop_token_ids: extra token ids that end the request.
        stop: stop strings; the detokenizer applies them, the engine only carries them.
        include_stop_str_in_output: keep the matched stop string in the text.
        seed: per-request seed; the same seed gives the same tokens whatever else is batched.
        skip_special_tokens / spaces_between_special_tokens: detokenizer options, carried.
        n: number of choices (fanned out before scheduling).
        return_logprob: return the chosen token's logprob.
        top_logprobs_num: also return this many most likely tokens with logprobs (0..20).
        prompt_logprobs: None, or return each prompt token's logprob (but the first's) with this
            many most likely alternatives (0..20; vLLM's ``prompt_logprobs``), computed during
            prefill (``pdserve.sampling.prompt_logprobs``).
        logit_bias: token id -> value in [-100, 100] added to that token's logit before penalties'
            bias, bans and sampling (OpenAI semantics: -100 bans a token, +100 all but forces it);
            logprobs stay those of the unbiased distribution.
        json_schema / regex / ebnf / structural_tag: at most one grammar the output is held to
            (``pdserve.constrained.GrammarSpec`` says what each kind means); EOS is allowed only
            where the grammar is complete, and logprobs are those of the masked distribution.
        speculative_num_draft_tokens: the most draft tokens this request verifies per step when the
            server speculates (``--speculative-algorithm``): 0 opts out, None takes the server's
            ``--speculative-num-draft-tokens``; it never raises the server's. What the request
            generates does not depend on it (greedy: the same tokens; sampled: the same distribution).
        priority: the request's scheduling priority under ``--schedule-policy priority`` (vLLM's:
            lower is served first, and may preempt a running request of higher value), in
            [-1000, 1000]; 0 under every other policy. Carried here so that it travels wherever
            the request does (gateway, decode and prefill workers); it does not change sampling.
        embed: also return the prompt's pooled, L2-normalised final hidden states (``/v1/embeddings``;
            ``pdserve.layers.pooler``); such a request generates exactly one token (``max_new_tokens`` 1),
            which its client does not read.
        lora_name: the LoRA adapter the request runs under (``pdserve.lora``; the ``model`` it
            named), at most ``MAX_LORA_NAME_CHARS`` characters; ``""``: the base model. Carried here
            so that prefill and decode workers both apply it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    return_logprob: bool = False
    top_logprobs_num: int = 0
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    speculative_num_draft_tokens: int | None = None
    priority: int = 0
    embed: bool = False
    lora_name: str = ""

    @property
    def grammar(self) -> GrammarSpec | None:
        """The request's grammar, or None when its output is unconstrained."""
        for kind in GRAMMAR_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return GrammarSpec(kind, text)
        return None

    @property
    def is_greedy(self) -> bool:
        """Argmax: temperature below ``GREEDY_TEMPERATURE`` (as vLLM) or ``top_k`` 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Check every field against ``pdserve.sampling.bounds``; with ``vocab_size``, also ``top_k``
        and the token ids of ``stop_token_ids`` and ``logit_bias`` against the vocabulary.

        Raises:
            BoundError: a ``ValueError`` naming the first field out of range and its allowed range.
        """
        for ok, name, message in self._range_checks():
            if not ok:
                raise BoundError(name, message)
        check_stop_strings(self.stop)
        check_grammars({kind: getattr(self, kind) for kind in GRAMMAR_KINDS}, self.ignore_eos)
        vocab = INT32_MAX if vocab_size is None else vocab_size
        check_vocab_fields(self.top_k, self.stop_token_ids, self.logit_bias, vocab)

    def _range_checks(self) -> list[tuple[bool, str, str]]:
        """``(ok, field, message)`` of each field's own range (int32/int64/float32 as on the wire)."""

        def real(x: object, lo: float, hi: float) -> bool:
            return isinstance(x, int | float) and math.isfinite(x) and lo <= x <= hi

        def integer(x: object, lo: int, hi: int) -> bool:
            return isinstance(x, int) and lo <= x <= hi

        return [
            (
                real(self.temperature, 0.0, FLOAT32_MAX),
                "temperature",
                f"must be >= 0, got {self.temperature}",
            ),
            (real(self.top_p, 0.0, 1.0) and self.top_p > 0, "top_p", f"must be in (0, 1], got {self.top_p}"),
            (
                integer(self.top_k, -1, INT32_MAX),
                "top_k",
                f"must be -1 or 0 (disabled) or >= 1, got {self.top_k}",
            ),
            (real(self.min_p, 0.0, 1.0), "min_p", f"must be in [0, 1], got {self.min_p}"),
            (
                real(self.repetition_penalty, 0.0, FLOAT32_MAX) and self.repetition_penalty > 0,
                "repetition_penalty",
                f"must be > 0, got {self.repetition_penalty}",
            ),
            (
                real(self.frequency_penalty, -2.0, 2.0),
                "frequency_penalty",
                f"must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                real(self.presence_penalty, -2.0, 2.0),
                "presence_penalty",
                f"must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                integer(self.max_new_tokens, 1, INT32_MAX),
                "max_new_tokens",
                f"must be in [1, {INT32_MAX}], got {self.max_new_tokens}",
            ),
            (
                integer(self.min_new_tokens, 0, self.max_new_tokens),
                "min_new_tokens",
                f"must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}",
            ),
            (integer(self.n, 1, MAX_N), "n", f"must be in [1, {MAX_N}], got {self.n}"),
            (
                integer(self.top_logprobs_num, 0, MAX_TOP_LOGPROBS),
                "top_logprobs_num",
                f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs_num}",
            ),
            (
                self.prompt_logprobs is None or integer(self.prompt_logprobs, 0, MAX_TOP_LOGPROBS),
                "prompt_logprobs",
                f"must be None or in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}",
            ),
            (
                self.seed is None or integer(self.seed, INT64_MIN, INT64_MAX),
                "seed",
                f"must be an int64 or None, got {self.seed!r}",
            ),
            (
                self.speculative_num_draft_tokens is None
                or integer(self.speculative_num_draft_tokens, 0, MAX_SPECULATIVE_DRAFT_TOKENS),
                "speculative_num_draft_tokens",
                f"must be in [0, {MAX_SPECULATIVE_DRAFT_TOKENS}] or unset, "
                f"got {self.speculative_num_draft_tokens!r}",
            ),
            (
                integer(self.priority, -MAX_PRIORITY, MAX_PRIORITY),
                "priority",
                f"must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {self.priority!r}",
            ),
            (
                all(real(v, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS) for v in self.logit_bias.values()),
                "logit_bias",
                f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            ),
            (
                isinstance(self.lora_name, str) and len(self.lora_name) <= MAX_LORA_NAME_CHARS,
                "lora_name",
                f"must be a string of at most {MAX_LORA_NAME_CHARS} characters",
            ),
            (
                not self.embed or self.max_new_tokens == 1,
                "embed",
                f"needs max_new_tokens 1 (an embedding generates nothing), got {self.max_new_tokens}",
            ),
        ]
