"""One colocated and one PD stack (float32, 32-token prefill chunks) shared by the prefill-only
paths' end-to-end tests of this package (scoring, embeddings): a package-scoped fixture, so each
topology starts once for them all; every scheduler's KV pool is conserved after each test."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.stack import Stack, launch_stack

FLAGS = (
    *("--dtype", "float32", "--max-total-tokens", "8192", "--chunked-prefill-size", "32"),
    *("--schedule-policy", "priority"),  # the scoring tests send priorities through both PD roles
)


@pytest.fixture(scope="package", params=["colocated", "pd"])
def served(request) -> Stack:
    pd = ("--num-prefill", "1", "--num-decode", "1")
    topology = ("--colocated",) if request.param == "colocated" else pd
    stack = launch_stack(*topology, *FLAGS, log_name=f"scoring-{request.param}")
    stack.extra["topology"] = request.param
    yield stack
    stack.stop()


@pytest.fixture
def stack(served: Stack) -> Stack:
    yield served
    served.check_kv_conservation()


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0)


def computed_prompt_tokens(stack: Stack) -> float:
    """Prompt tokens the schedulers that compute prompts (mixed, prefill) took from no cache so far."""
    m = stack.metrics()
    hits, queries = m["pdserve:prefix_cache_hit_tokens_total"], m["pdserve:prefix_cache_queries_total"]
    return sum(queries[k] - hits.get(k, 0.0) for k in queries if k[0] in ("mixed", "prefill"))


def ranks_within_tol(ref: torch.Tensor, token: int, tol: float) -> range:
    """The ranks (vLLM's: 1 + the tokens more likely) ``token`` may have under ``ref`` (``[V]``
    reference logprobs) for a server whose logprobs are within ``tol`` of them."""
    lp = float(ref[token])
    return range(int((ref > lp + tol).sum()) + 1, int((ref > lp - tol).sum()) + 1)
