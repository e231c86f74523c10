"""The overlapped step (schedule N+1 before processing N) against the step-by-step one, and isolation of
a failing request: on the real model, transport-free."""

from __future__ import annotations

import pytest

from pdserve.engine.model_runner import ModelRunner
from pdserve.scheduler.req import FinishReason, ReqState
from tests.reference import hf_greedy
from tests.scheduler.driver import POISON_SEED, PoisonedSampler, drive, fresh, ids, make_runner, req, step


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return make_runner(8192)


def mixed_requests():
    """Greedy and sampled requests with every per-request option the step's bookkeeping touches."""
    long_prompt = ids(" ".join(["Summarize: the quick brown fox jumps over the lazy dog."] * 8))
    return [
        req("greedy", ids("Write one sentence about the sea."), max_new=12),
        req("chunked", long_prompt, max_new=6),
        req("seeded", ids("Name three colours:"), max_new=10, temperature=0.9, top_p=0.9, seed=7),
        req("top-k", ids("Count:"), max_new=8, temperature=1.2, top_k=5, seed=11),
        req("logprobs", ids("Hello"), max_new=5, return_logprob=True, top_logprobs_num=3),
        req("penalised", ids("Repeat after me: la la la"), max_new=9, frequency_penalty=1.5),
        req("min-tokens", ids("Hi"), max_new=7, min_new_tokens=4, stop_token_ids=[13]),
        req("one-token", ids("Yes or no?"), max_new=1),
    ]


def test_overlap_gives_exactly_the_tokens_of_the_step_by_step_loop(runner):
    results = {}
    for overlap in (True, False):
        sched = fresh(runner, role="mixed", chunked_prefill_size=32)
        for r in mixed_requests():
            sched.add_request(r)
        done = drive(sched, overlap=overlap)
        results[overlap] = {r: (d.output_ids, d.output_logprobs, d.finish_reason) for r, d in done.items()}
    assert results[True] == results[False]
    assert len(results[True]["one-token"][0]) == 1
    assert results[True]["greedy"][0] == hf_greedy(ids("Write one sentence about the sea."), 12)


def test_requests_arriving_while_a_step_runs_join_the_next_one(runner):
    """Requests added between the overlapped steps (as the loop's inbox does) decode correctly."""
    prompts = {f"late{i}": ids(f"Tell me about the number {i}.") for i in range(3)}
    sched = fresh(runner, role="mixed")
    sched.add_request(req("first", ids("Once upon a time"), max_new=10))
    done, prev = {}, None
    for n in range(200):
        if n in (1, 2, 4):
            rid = f"late{(1, 2, 4).index(n)}"
            sched.add_request(req(rid, prompts[rid], max_new=6))
        outputs, prev = step(sched, prev, overlap=True)
        done |= {o.req.rid: o.req for o in outputs if o.finished}
        sched.check_invariants()
        if prev is None and not sched.has_work() and n > 4:
            break
    for rid, prompt in prompts.items():
        assert done[rid].output_ids == hf_greedy(prompt, 6), rid
    assert sched.ledger.used_pages() == 0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_forward_failure_fails_only_the_request_responsible(runner, monkeypatch, overlap):
    """Eight greedy requests decode; a poisoned request joins them at once and another mid-decode:
    both fail with the forward's error, the eight finish with HF's greedy tokens, no page leaks."""
    prompts = {f"ok{i}": ids(f"Write a short line about the number {i}.") for i in range(8)}
    monkeypatch.setattr(runner, "sampler", PoisonedSampler(runner.sampler))
    sched = fresh(runner, role="mixed")
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, max_new=10))
    sched.add_request(req("bad-early", ids("Hello"), max_new=10, temperature=1.0, seed=POISON_SEED))

    def on_step(n, s):
        if n == 4:
            s.add_request(req("bad-late", ids("Hi there"), max_new=10, temperature=1.0, seed=POISON_SEED))

    done = drive(sched, overlap=overlap, on_step=on_step)
    for rid in ("bad-early", "bad-late"):
        assert done[rid].state is ReqState.FAILED and done[rid].finish_reason is FinishReason.ERROR
        assert "injected failure" in done[rid].error
    for rid, prompt in prompts.items():
        assert done[rid].state is ReqState.FINISHED, done[rid].error
        assert done[rid].output_ids == hf_greedy(prompt, 10), rid


def test_bad_sampling_inputs_fail_only_their_request(runner):
    """A request whose parameters break building the batch (here a logit_bias value that is no number,
    set after admission checks: ids outside the vocabulary are dropped by the build itself) fails
    alone; the others run on."""
    sched = fresh(runner, role="mixed")
    good = ids("The capital of France is")
    sched.add_request(req("good", good, max_new=6))
    bad = req("bad", ids("Hello"), max_new=6)
    sched.add_request(bad)
    bad.sampling_params.logit_bias = {5: "not a number"}
    done = drive(sched, overlap=True)
    assert done["bad"].finish_reason is FinishReason.ERROR and "invalid sampling inputs" in done["bad"].error
    assert done["good"].output_ids == hf_greedy(good, 6)
