"""What the clients return: streamed ``Delta`` pieces, whole ``GenerateResult`` s, model cards."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from pdserve_sdk import _wire

FinishReason = Literal["stop", "length", "abort", "error"]

# pdserve.v1.FinishReason number -> "stop", "length", ... (UNSPECIFIED, i.e. not finished, left out)
_FINISH_REASONS = cast(
    dict[int, FinishReason],
    {n: name.removeprefix("FINISH_REASON_").lower() for n, name in _wire.FINISH_REASONS.items() if n},
)


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Logprob (natural log) of one generated token and its top alternatives (before sampling filters)."""

    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of a request: prompt, generated, and prompt tokens served from the radix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Delta:
    """One streamed piece of choice ``index``: new ``text`` and ``token_ids`` since the previous piece.

    ``finish_reason``, ``matched_stop`` (the stop string that ended it, ``""`` if none),
    ``matched_stop_token`` (the stop token id that ended it: EOS or one of ``stop_token_ids``; None if
    none) and ``usage`` are set on the last piece of a choice only; ``prompt_logprobs`` (prompt
    tokens 1.., when asked for) on its first piece.
    """

    rid: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    matched_stop: str = ""
    matched_stop_token: int | None = None
    usage: Usage | None = None


@dataclass(slots=True)
class Choice:
    """One whole sample: the concatenation of its deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: str = ""
    matched_stop_token: int | None = None


@dataclass(slots=True)
class GenerateResult:
    """A finished request: ``choices`` ordered by index (one unless ``n`` > 1).

    ``text``, ``token_ids``, ``logprobs`` and ``finish_reason`` are those of choice 0. ``usage``
    counts the prompt once and the completion tokens of all choices.
    """

    rid: str
    choices: list[Choice]
    usage: Usage

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return self.choices[0].logprobs

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.choices[0].finish_reason


@dataclass(frozen=True, slots=True)
class ModelCard:
    """A served model: its id (the ``model`` to request), context length in tokens and, for a LoRA
    adapter, its base model (``parent``; "" for the base model)."""

    id: str
    context_length: int
    parent: str = ""


@dataclass(frozen=True, slots=True)
class EmbedResult:
    """Each input's embedding (L2-normalised float32 values, in input order) and the prompt tokens of
    all inputs."""

    embeddings: tuple[tuple[float, ...], ...]
    prompt_tokens: int


def embed_result_from_pb(pb: Any) -> EmbedResult:
    """An ``EmbedResult`` from a ``pdserve.v1.EmbedResponse``."""
    return EmbedResult(tuple(tuple(e.values) for e in pb.data), pb.usage.prompt_tokens)


def delta_from_pb(pb: Any) -> Delta:
    """A ``Delta`` from one ``pdserve.v1.GenerateResponse``."""
    return Delta(
        rid=pb.rid,
        index=pb.index,
        text=pb.text,
        token_ids=tuple(pb.token_ids),
        logprobs=tuple(_token_logprob(lp) for lp in pb.logprobs),
        prompt_logprobs=tuple(_token_logprob(lp) for lp in pb.prompt_logprobs),
        finish_reason=_FINISH_REASONS.get(pb.finish_reason),
        matched_stop=pb.matched_stop,
        matched_stop_token=pb.matched_stop_token if pb.HasField("matched_stop_token") else None,
        usage=Usage(pb.usage.prompt_tokens, pb.usage.completion_tokens, pb.usage.cached_tokens)
        if pb.HasField("usage")
        else None,
    )


def _token_logprob(lp: Any) -> TokenLogprob:
    return TokenLogprob(lp.token_id, lp.logprob, tuple(TopLogprob(t.token_id, t.logprob) for t in lp.top))


def collect(deltas: Iterable[Delta]) -> GenerateResult:
    """Concatenate a request's deltas into its ``GenerateResult``."""
    rid = ""
    choices: dict[int, Choice] = {}
    usages: dict[int, Usage] = {}
    for delta in deltas:
        rid = rid or delta.rid
        choice = choices.setdefault(delta.index, Choice(delta.index))
        choice.text += delta.text
        choice.token_ids.extend(delta.token_ids)
        choice.logprobs.extend(delta.logprobs)
        choice.prompt_logprobs.extend(delta.prompt_logprobs)
        if delta.finish_reason is not None:
            choice.finish_reason, choice.matched_stop = delta.finish_reason, delta.matched_stop
            choice.matched_stop_token = delta.matched_stop_token
        if delta.usage is not None:
            usages[delta.index] = delta.usage
    return GenerateResult(rid, [choices[i] for i in sorted(choices)], _total_usage(usages))


def _total_usage(usages: dict[int, Usage]) -> Usage:
    if not usages:
        return Usage(0, 0, 0)
    first = usages[min(usages)]
    return Usage(first.prompt_tokens, sum(u.completion_tokens for u in usages.values()), first.cached_tokens)
