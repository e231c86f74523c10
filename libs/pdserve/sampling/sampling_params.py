"""Per-request sampling parameters (the OpenAI / SGLang set)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.constrained.spec import GRAMMAR_KINDS, GrammarSpec

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling (Holtzman et al. 2019): keep the most likely tokens whose mass
            reaches ``top_p``; 1 disables.
        top_k: keep the ``top_k`` most likely tokens; -1 or 0 disables.
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
        logit_bias: token id -> value in [-100, 100] added to that token's logit before penalties'
            bias, bans and sampling (OpenAI semantics: -100 bans a token, +100 all but forces it);
            logprobs stay those of the unbiased distribution.
        json_schema / regex / ebnf / structural_tag: at most one grammar the output is held to
            (``pdserve.constrained.GrammarSpec`` says what each kind means); EOS is allowed only
            where the grammar is complete, and logprobs are those of the masked distribution.
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
    logit_bias: dict[int, float] = field(default_factory=dict)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

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
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Check every field; with ``vocab_size``, also that ``logit_bias`` names tokens below it.

        Raises:
            ValueError: naming the first field out of range and its allowed range.
        """
        checks = [
            (
                math.isfinite(self.temperature) and self.temperature >= 0,
                f"temperature must be >= 0, got {self.temperature}",
            ),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (
                0 <= self.min_new_tokens <= self.max_new_tokens,
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}",
            ),
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (
                0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS,
                f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs_num}",
            ),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}",
            ),
            (
                all(isinstance(s, str) and s for s in self.stop),
                f"stop must be non-empty strings, got {self.stop}",
            ),
            (
                self.seed is None or isinstance(self.seed, int),
                f"seed must be an int or None, got {self.seed!r}",
            ),
            (
                all(
                    isinstance(t, int) and t >= 0 and (vocab_size is None or t < vocab_size)
                    for t in self.logit_bias
                ),
                f"logit_bias keys must be token ids in [0, {vocab_size or 'vocab size'}), "
                f"got {sorted(self.logit_bias)}",
            ),
            (
                all(math.isfinite(v) and abs(v) <= MAX_LOGIT_BIAS for v in self.logit_bias.values()),
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self._validate_grammar()

    def _validate_grammar(self) -> None:
        given = [kind for kind in GRAMMAR_KINDS if getattr(self, kind) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one of {', '.join(GRAMMAR_KINDS)} may be set, got {', '.join(given)}")
        if given:
            if self.ignore_eos:
                raise ValueError(
                    f"ignore_eos cannot be combined with {given[0]}: the grammar decides the end"
                )
            self.grammar.validate()
