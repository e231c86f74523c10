"""Prompt token counts: the server's own tokenize endpoint when it has one, else an estimate.

Known endpoints, probed in this order: ``POST /tokenize {"prompt"}`` (pdserve, vLLM),
``POST /v1/tokenize {"prompt"}`` (SGLang) and ``POST /tokenize {"content"}`` (llama.cpp server).
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from dataclasses import dataclass

import httpx

from benchmarks.serving_lib.workload import random_words

log = logging.getLogger(__name__)

# One token per word piece, per digit and per punctuation mark: close for English text under BPE.
_PIECES = re.compile(r"\d|[^\W\d]+|[^\w\s]")
CALIBRATION_WORDS = 512


def estimate_tokens(text: str) -> int:
    """Rough token count of ``text`` without a tokenizer (words, single digits and punctuation)."""
    return len(_PIECES.findall(text))


@dataclass(frozen=True, slots=True)
class _Endpoint:
    path: str
    field: str


ENDPOINTS = (
    _Endpoint("/tokenize", "prompt"),
    _Endpoint("/v1/tokenize", "prompt"),
    _Endpoint("/tokenize", "content"),
)


class TokenCounter:
    """Counts prompt tokens through a server's tokenize endpoint, or estimates them.

    Build it with :meth:`connect` and use it as an async context manager (which closes its HTTP
    client); ``source`` says which endpoint answers (or ``"estimate"``).

    Args:
        root_url: the server's root URL (no ``/v1``), e.g. ``http://127.0.0.1:8000``.
        model: model name sent along (vLLM and pdserve accept it; llama.cpp ignores it).
        api_key: bearer token, if the server requires one.
    """

    def __init__(self, root_url: str, model: str, api_key: str | None = None, timeout: float = 60.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=root_url.rstrip("/"), headers=headers, timeout=timeout)
        self._model = model
        self._endpoint: _Endpoint | None = None
        self._limit = asyncio.Semaphore(8)

    @classmethod
    async def connect(cls, root_url: str, model: str, api_key: str | None = None) -> TokenCounter:
        """A counter bound to the first tokenize endpoint of :data:`ENDPOINTS` the server answers."""
        counter = cls(root_url, model, api_key)
        for endpoint in ENDPOINTS:
            try:
                if await counter._remote_count(endpoint, "hello world") > 0:
                    log.info("prompt tokens counted by %s%s", root_url, endpoint.path)
                    counter._endpoint = endpoint
                    return counter
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
        log.info("no tokenize endpoint at %s: prompt tokens are estimated", root_url)
        return counter

    @property
    def source(self) -> str:
        """``"POST /tokenize {prompt}"``-style description of the endpoint in use, or ``"estimate"``."""
        return (
            "estimate" if self._endpoint is None else f"POST {self._endpoint.path} {{{self._endpoint.field}}}"
        )

    async def count(self, prompts: list[str]) -> list[int]:
        """Token count of every prompt (with the special tokens the server adds, when counted remotely).

        Raises httpx.HTTPError if a bound endpoint stops answering.
        """
        if self._endpoint is None:
            return [estimate_tokens(p) for p in prompts]
        return list(await asyncio.gather(*(self._remote_count(self._endpoint, p) for p in prompts)))

    async def tokens_per_word(self, seed: int = 0) -> float:
        """Tokens per word of ``workload.WORDS`` on the served tokenizer (1.0 when estimating)."""
        if self._endpoint is None:
            return 1.0
        text = random_words(random.Random(seed), CALIBRATION_WORDS)
        return (await self._remote_count(self._endpoint, text)) / CALIBRATION_WORDS

    async def __aenter__(self) -> TokenCounter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def _remote_count(self, endpoint: _Endpoint, text: str) -> int:
        body = {endpoint.field: text}
        if endpoint.field == "prompt":
            body["model"] = self._model
        async with self._limit:
            resp = await self._http.post(endpoint.path, json=body)
        resp.raise_for_status()
        data = resp.json()
        return int(data["count"]) if "count" in data else len(data["tokens"])
