"""``Scheduler.add_request`` refuses every field outside ``pdserve.sampling.bounds`` (its internal port
is reachable, so it checks what the gateway checks), naming the field and queueing nothing; a
request at each bound is taken."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.sampling import bounds
from pdserve.sampling.bounds import BoundError
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.req import Req
from pdserve.scheduler.scheduler import Scheduler
from tests.scheduler.test_scheduler import fresh, make_runner, req

INT32, INT64 = 2**31, 2**63


@pytest.fixture(scope="module")
def sched() -> Scheduler:
    return fresh(make_runner(1024), role="mixed")


@pytest.fixture(scope="module")
def vocab(sched: Scheduler) -> int:
    return sched.runner.model_config.vocab_size


def too_many_stops() -> list[str]:
    return [f"s{i}" for i in range(bounds.MAX_STOP_STRINGS + 1)]


def too_long_in_all() -> list[str]:
    per = bounds.MAX_STOP_STRING_CHARS
    return ["x" * per] * (bounds.MAX_STOP_TOTAL_CHARS // per + 1)


# (field named in the error, sampling params); callables take the vocabulary size
OUT_OF_BOUNDS = {
    "top_k-above-vocab": ("top_k", lambda v: {"top_k": v + 1}),
    "top_k-int32": ("top_k", lambda v: {"top_k": INT32}),
    "top_k-below-minus-one": ("top_k", lambda v: {"top_k": -2}),
    "stop_token_ids-vocab": ("stop_token_ids", lambda v: {"stop_token_ids": [v]}),
    "stop_token_ids-int32": ("stop_token_ids", lambda v: {"stop_token_ids": [2**32]}),
    "stop_token_ids-negative": ("stop_token_ids", lambda v: {"stop_token_ids": [-1]}),
    "stop_token_ids-count": (
        "stop_token_ids",
        lambda v: {"stop_token_ids": [1] * (bounds.MAX_STOP_TOKEN_IDS + 1)},
    ),
    "logit_bias-vocab": ("logit_bias", lambda v: {"logit_bias": {v: 1.0}}),
    "logit_bias-int32": ("logit_bias", lambda v: {"logit_bias": {INT32: 1.0}}),
    "logit_bias-value": ("logit_bias", lambda v: {"logit_bias": {1: 100.5}}),
    "logit_bias-count": (
        "logit_bias",
        lambda v: {"logit_bias": dict.fromkeys(range(bounds.MAX_LOGIT_BIAS_ENTRIES + 1), 1.0)},
    ),
    "stop-count": ("stop", lambda v: {"stop": too_many_stops()}),
    "stop-length": ("stop", lambda v: {"stop": ["x" * (bounds.MAX_STOP_STRING_CHARS + 1)]}),
    "stop-total": ("stop", lambda v: {"stop": too_long_in_all()}),
    "stop-empty": ("stop", lambda v: {"stop": [""]}),
    "seed-int64": ("seed", lambda v: {"seed": INT64}),
    "seed-below-int64": ("seed", lambda v: {"seed": -INT64 - 1}),
    "n-zero": ("n", lambda v: {"n": 0}),
    "n-too-many": ("n", lambda v: {"n": bounds.MAX_N + 1}),
    "max_new_tokens-int32": ("max_new_tokens", lambda v: {"max_new_tokens": INT32}),
    "max_new_tokens-zero": ("max_new_tokens", lambda v: {"max_new_tokens": 0}),
    "min_new_tokens-above-max": ("min_new_tokens", lambda v: {"max_new_tokens": 4, "min_new_tokens": 5}),
    "top_logprobs_num": ("top_logprobs_num", lambda v: {"top_logprobs_num": bounds.MAX_TOP_LOGPROBS + 1}),
    "speculative-above": (
        "speculative_num_draft_tokens",
        lambda v: {"speculative_num_draft_tokens": bounds.MAX_SPECULATIVE_DRAFT_TOKENS + 1},
    ),
    "speculative-negative": ("speculative_num_draft_tokens", lambda v: {"speculative_num_draft_tokens": -1}),
    "temperature-inf": ("temperature", lambda v: {"temperature": float("inf")}),
    "temperature-nan": ("temperature", lambda v: {"temperature": float("nan")}),
    "top_p-zero": ("top_p", lambda v: {"top_p": 0.0}),
    "repetition_penalty-inf": ("repetition_penalty", lambda v: {"repetition_penalty": float("inf")}),
    "presence_penalty": ("presence_penalty", lambda v: {"presence_penalty": 2.5}),
    "embed-generating": ("embed", lambda v: {"embed": True}),  # an embedding generates 1 token only
}


@pytest.mark.parametrize(("field", "params"), OUT_OF_BOUNDS.values(), ids=OUT_OF_BOUNDS)
def test_add_request_refuses_a_field_out_of_bounds(sched, vocab, field, params) -> None:
    fields = {"temperature": 0.0, "max_new_tokens": 8} | params(vocab)
    with pytest.raises(BoundError) as info:
        sched.add_request(Req("bad", [1, 2, 3], SamplingParams(**fields)))
    assert info.value.field == field
    assert str(info.value).startswith(field)
    assert not sched.reqs and not sched.queue.waiting


def test_add_request_takes_every_field_at_its_bound(sched, vocab) -> None:
    per = bounds.MAX_STOP_STRING_CHARS
    at_bounds = req(
        "edge",
        [0, vocab - 1],
        max_new=2,
        top_k=vocab,
        stop_token_ids=[vocab - 1] * bounds.MAX_STOP_TOKEN_IDS,
        logit_bias={i: -100.0 for i in range(vocab - bounds.MAX_LOGIT_BIAS_ENTRIES, vocab)},
        stop=["x" * per] * (bounds.MAX_STOP_TOTAL_CHARS // per),
        seed=INT64 - 1,
        top_logprobs_num=bounds.MAX_TOP_LOGPROBS,
        speculative_num_draft_tokens=bounds.MAX_SPECULATIVE_DRAFT_TOKENS,
    )
    sched.add_request(at_bounds)
    sched.add_request(req("edge-low", [1], max_new=2, top_k=-1, seed=-INT64, speculative_num_draft_tokens=0))
    assert sched.abort_request("edge") and sched.abort_request("edge-low")
    assert len(sched.pop_aborted()) == 2
    sched.check_invariants()


def test_add_request_refuses_an_embedding_where_the_models_pooling_is_not_served(sched) -> None:
    limits = sched.reqs.limits
    sched.reqs.limits = dataclasses.replace(limits, pooling=None)  # a sentence-transformers cls model
    try:
        with pytest.raises(BoundError) as info:
            sched.add_request(
                Req("emb", [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=1, embed=True))
            )
        assert info.value.field == "embed"
        assert not sched.reqs and not sched.queue.waiting
    finally:
        sched.reqs.limits = limits
