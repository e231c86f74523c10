"""Prompt logprobs computed in prefill equal HF transformers' float32 log_softmax on the same prompt:
in one extend, in chunks, beside other requests, after a radix-cache hit (which the request must not
use), and under forward-failure bisection; pages are conserved after each (``drive`` checks)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.sampling.prompt_logprobs import PromptLogprobRows
from pdserve.scheduler.req import Req
from tests.reference import hf_prompt_logprobs
from tests.scheduler.driver import drive, fresh, ids, make_runner, req
from tests.scoring.conftest import ranks_within_tol

TOL = 1e-4
TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
    "step, and every step of it is scored token by token by the model that reads it."
)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return make_runner(max_total_tokens=4096)


def check(r: Req, top: int) -> None:
    """``r``'s prompt logprobs (tokens 1..L-1, each with its ``top`` alternatives) equal HF's."""
    prompt = r.origin_input_ids
    ref = hf_prompt_logprobs(tuple(prompt))
    assert [t for t, _, _, _ in r.prompt_logprobs] == prompt[1:]
    for pos, (token, logprob, alternatives, rank) in enumerate(r.prompt_logprobs):
        assert abs(logprob - float(ref[pos, token])) < TOL, (pos, logprob, float(ref[pos, token]))
        assert rank in ranks_within_tol(ref[pos], token, TOL)
        assert len(alternatives) == top
        values, indices = ref[pos].topk(top)
        for (alt, alt_lp), want in zip(alternatives, values.tolist(), strict=True):
            assert abs(alt_lp - want) < TOL
            assert abs(alt_lp - float(ref[pos, alt])) < TOL  # ties may order differently
        if top:
            assert alternatives[0][0] == int(indices[0]) or abs(alternatives[0][1] - float(values[0])) < TOL


@pytest.mark.parametrize("chunk", [512, 16], ids=["one-extend", "chunked"])
def test_prompt_logprobs_equal_hf(runner, chunk):
    prompt = ids(TEXT)
    assert len(prompt) > 2 * 16  # several chunks of 16
    sched = fresh(runner, chunked_prefill_size=chunk)
    sched.add_request(req("scored", prompt, max_new=1, prompt_logprobs=5))
    sched.add_request(req("plain", ids("Hello there, how are you?"), max_new=4))
    done = drive(sched, overlap=True)
    check(done["scored"], 5)
    assert done["plain"].prompt_logprobs == []


def test_a_radix_hit_is_not_used_by_a_request_that_scores_its_prompt(runner):
    prompt = ids(TEXT)
    sched = fresh(runner)
    sched.add_request(req("warm", prompt, max_new=2))
    drive(sched)
    sched.add_request(req("scored", prompt, max_new=2, prompt_logprobs=0))
    sched.add_request(req("hit", prompt, max_new=2))
    done = drive(sched)
    assert done["scored"].cached_tokens == 0
    assert done["hit"].cached_tokens >= 16  # the cache still serves everyone else
    check(done["scored"], 0)
    assert done["scored"].output_ids == done["hit"].output_ids


def test_isolating_a_failed_forward_keeps_prompt_logprobs(runner, monkeypatch):
    """A batch whose forward raises is bisected (``batch_runner``): the sub-batches still score."""
    sched = fresh(runner)
    sched.add_request(req("a", ids(TEXT), max_new=1, prompt_logprobs=2))
    sched.add_request(req("b", ids("One two three four five six"), max_new=1, prompt_logprobs=1))
    real = runner.forward_batch_generation
    calls = []

    def fail_first(fb):
        calls.append(fb.batch_size)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(fb)

    monkeypatch.setattr(runner, "forward_batch_generation", fail_first)
    done = drive(sched)
    assert calls[:3] == [2, 1, 1]
    check(done["a"], 2)
    check(done["b"], 1)


def test_prompt_logprobs_are_bounded_in_add_request(runner):
    sched = fresh(runner)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        sched.add_request(req("x", [1, 2, 3], prompt_logprobs=21))
    with pytest.raises(ValueError, match="prompt_logprobs needs a prompt of at most 4096"):
        sched.add_request(req("y", [1] * 4097, prompt_logprobs=0))


def test_rows_of_a_request_that_does_not_score_are_all_sampled():
    """A scoring request samples from its last row only; another request's rows (a verify's k + 1)
    all go to the sampler; the scored rows are log_softmax of the raw logits."""
    rows = PromptLogprobRows([4, 3, 1], [[7, 8, 9], [], []], [2, None, None])
    assert rows.sample_rows(torch.device("cpu")).tolist() == [3, 4, 5, 6, 7]
    assert rows.num_prompt_only_rows == 3
    logits = torch.randn(8, 10)
    scored, other, last = rows.compute(logits)
    ref = logits[:3].log_softmax(-1)
    assert [t for t, _, _, _ in scored] == [7, 8, 9] and other == last == []
    for pos, (token, logprob, top, rank) in enumerate(scored):
        assert logprob == pytest.approx(float(ref[pos, token]), abs=1e-6)
        assert [t for t, _ in top] == ref[pos].topk(2).indices.tolist()
        assert rank == 1 + int((ref[pos] > ref[pos, token]).sum())  # also outside the top 2
    sub = rows.select([1, 0])
    assert sub.sample_rows(torch.device("cpu")).tolist() == [0, 1, 2, 6]
