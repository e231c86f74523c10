"""POST /v1/embeddings: OpenAI's embeddings for decoder models.

Each input is a prompt that the runtime prefills as any other request, batched with generation; its
extend pools the final hidden states as the model's config implies (``pdserve.layers.pooler``: the
last token, or the mean where a sentence-transformers pooling config says mean), L2-normalised in
float32, and the request ends after that prefill: the one token it samples is dropped. No radix
cache prefix is used for it (its KV enters the cache afterwards as any other prompt's). In PD the
prefill worker pools, and its answer carries the embedding to the decode worker, which ends the
request at once. Identical inputs of one request are computed once, and their vector is copied to
each (``EmbeddingRequest.distinct``): usage still counts every input's tokens.

``dimensions`` (Matryoshka-style, as OpenAI and vLLM do): the first ``dimensions`` values,
L2-normalised again; it must be in ``[1, hidden_size]`` (400 otherwise). ``encoding_format``
``base64`` sends each vector as the base64 of its little-endian float32 bytes (what the official
client decodes by default).
"""

from __future__ import annotations

import base64
import math
from typing import Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.sampling.bounds import INT32_MAX, MAX_EMBEDDING_INPUTS
from pdserve.services.gateway.errors import GatewayError, invalid_request
from pdserve.services.gateway.io_struct import GenerateReqInput, SamplingParams
from pdserve.services.gateway.openai.protocol_fields import RequestModel, TokenId
from pdserve.services.gateway.openai.serving_common import (
    ChoiceResult,
    ServingContext,
    collect,
    log_unknown_fields,
    request_id,
    submit,
)


def _as_inputs(v: str | list) -> list:
    """``input`` as a list of inputs: a string or one token-id list is one input."""
    return [v] if isinstance(v, str) or (v and isinstance(v[0], int)) else list(v)


class EmbeddingRequest(RequestModel):
    """POST /v1/embeddings. ``input``: a string, a list of strings, token ids, or a list of
    token-id lists (at most ``MAX_EMBEDDING_INPUTS`` inputs, none empty); unknown fields (``user``)
    are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=INT32_MAX)

    @field_validator("input")
    @classmethod
    def _inputs_within_bounds(cls, v):
        inputs = _as_inputs(v)
        if not inputs or any(not p for p in inputs):
            raise ValueError("input must not be empty (nor any of its inputs)")
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"input has {len(inputs)} inputs; at most {MAX_EMBEDDING_INPUTS} are served")
        return v

    def inputs(self) -> list[str | list[int]]:
        """The inputs: strings or token-id lists."""
        return _as_inputs(self.input)

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def distinct(self) -> tuple[list[str | list[int]], list[int]]:
        """The distinct inputs (in first-seen order), and for each input the index of its own among them."""
        first: dict[str | tuple[int, ...], int] = {}
        where = [first.setdefault(p if isinstance(p, str) else tuple(p), len(first)) for p in self.inputs()]
        distinct = [p if isinstance(p, str) else list(p) for p in first]
        return distinct, where

    def generate_req(self, rid: str) -> GenerateReqInput:
        """The runtime request: each distinct input prefilled once, pooled, with one greedy token it drops."""
        sampling = SamplingParams(temperature=0.0, max_new_tokens=1, embed=True)
        return GenerateReqInput(rid, self.distinct()[0], sampling)

    def answer(self, results: list[ChoiceResult], prompt_tokens: list[int]) -> tuple[list[list[float]], int]:
        """Each input's vector (``vectors``, in input order) and the prompt tokens of every input,
        from the ``results`` and ``prompt_tokens`` of the distinct inputs (``generate_req``).

        Raises:
            GatewayError: as ``vectors``.
        """
        unique, where = vectors(results, self.dimensions), self.distinct()[1]
        return [unique[i] for i in where], sum(prompt_tokens[i] for i in where)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def vectors(results: list[ChoiceResult], dimensions: int | None) -> list[list[float]]:
    """Each input's embedding (in input order) from its choice, cut to ``dimensions`` (``truncated``).

    Raises:
        GatewayError: 500 when the runtime returned no embedding; ``truncated``'s 400.
    """
    if any(not r.embedding for r in results):
        raise GatewayError(500, "the runtime returned no embedding")
    return [truncated(r.embedding, dimensions) for r in sorted(results, key=lambda r: r.index)]


def truncated(vector: list[float], dimensions: int | None) -> list[float]:
    """``vector`` cut to its first ``dimensions`` values and L2-normalised again in float32 (None:
    whole).

    Raises:
        GatewayError: 400 naming ``dimensions`` when it exceeds the vector's length (the model's
            hidden size).
    """
    if dimensions is not None:
        if dimensions > len(vector):
            raise invalid_request(
                f"dimensions must be in [1, {len(vector)}] (the model's hidden size), got {dimensions}",
                param="dimensions",
            )
        values = np.asarray(vector[:dimensions], dtype=np.float32)
        norm = float(np.sqrt(np.dot(values.astype(np.float64), values)))
        vector = (values / np.float32(norm) if norm > 0 and math.isfinite(norm) else values).tolist()
    return vector


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """``vector`` as floats, or as the base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


class OpenAIServingEmbedding:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, body: EmbeddingRequest, request: Request) -> Response:
        """Serve one embeddings request. Raises ``GatewayError``: 400 for an input over the context
        (``context_length_exceeded``, naming ``input``) or a ``dimensions`` over the hidden size, the
        runtime's errors as for completions."""
        adapter = self.ctx.check_model(body.model)
        rid = request_id(request)
        log_unknown_fields(rid, body.unknown_fields())
        obj = body.generate_req(rid)
        obj.sampling_params.lora_name = adapter
        handle = await submit(request, self.ctx.manager, obj)
        results = await collect(request, handle)
        vecs, tokens = body.answer(results, handle.prompt_tokens)
        data = [Embedding(index=i, embedding=encoded(v, body.encoding_format)) for i, v in enumerate(vecs)]
        response = EmbeddingResponse(
            data=data,
            model=self.ctx.response_model(body.model),
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )
        return JSONResponse(response.model_dump())
