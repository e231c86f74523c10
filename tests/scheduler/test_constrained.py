"""Constrained requests in the scheduler core on the real model: grammar queue, masks, retraction."""

from __future__ import annotations

import asyncio
import json
import math
import time

import grpc
import jsonschema
import pytest

from pdserve.constrained.backend import GrammarBackend
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.req import FinishReason, Req
from pdserve.scheduler.scheduler import Scheduler, SchedulerConfig
from pdserve.services.common.grammar_wait import grammar_error
from tests.reference import chat_ids, hf_constrained_greedy, hf_greedy, hf_tokenizer
from tests.scheduler.driver import drive, make_runner

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    backend = GrammarBackend(hf_tokenizer, 49152, [2])
    yield backend
    backend.close()


def scheduler(runner, backend: GrammarBackend, **config) -> Scheduler:
    sched = Scheduler(runner, SchedulerConfig(**config), grammar_backend=backend)
    sched.ledger.tree.reset()
    return sched


def add(sched: Scheduler, rid: str, prompt: list[int], **params) -> Req:
    req = Req(rid, prompt, SamplingParams(**{"temperature": 0.0, "max_new_tokens": 64} | params))
    sched.add_request(req)
    future = sched.grammar_future(rid)
    if future is not None:
        future.exception(timeout=120)  # compiled (or failed) before the steps run
    return req


def text(req: Req) -> str:
    return hf_tokenizer().decode(req.output_ids, skip_special_tokens=True)


def ask(question: str) -> list[int]:
    return chat_ids([{"role": "user", "content": question}])


@pytest.fixture(scope="module")
def big_runner():
    return make_runner(8192)


@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_rows_mixed_with_free_ones_match_hf(big_runner, backend, overlap):
    """Also overlapped: a constrained row waits for its pending token (its next mask follows from it)
    while the free row's next step could be scheduled ahead."""
    sched = scheduler(big_runner, backend)
    schema, regex = json.dumps(PERSON), r"(yes|no), because [a-z ]{1,30}\."
    person, sky, free = ask("Describe a person as JSON."), ask("Is the sky blue?"), ask("Name a fruit.")
    add(sched, "json", person, json_schema=schema)
    add(sched, "regex", sky, regex=regex)
    add(sched, "free", free, max_new_tokens=16)
    add(sched, "sampled", person, json_schema=schema, temperature=0.9, seed=7)
    done = drive(sched, overlap=overlap)
    assert done["json"].output_ids == hf_constrained_greedy(person, 64, "json_schema", schema)
    assert done["regex"].output_ids == hf_constrained_greedy(sky, 64, "regex", regex)
    assert done["free"].output_ids == hf_greedy(free, 16)
    for rid in ("json", "sampled"):
        assert done[rid].finish_reason == FinishReason.STOP and done[rid].output_ids[-1] == 2
        jsonschema.validate(json.loads(text(done[rid])), PERSON)


def test_logprobs_are_those_of_the_masked_distribution(big_runner, backend):
    sched = scheduler(big_runner, backend)
    add(sched, "c", ask("Is the sky blue?"), regex="(yes|no)", return_logprob=True, top_logprobs_num=20)
    req = drive(sched)["c"]
    assert text(req) in ("yes", "no")
    token, logprob, top = req.output_logprobs[0]
    allowed = [hf_tokenizer().decode([t]) for t, _ in top]
    assert all("yes".startswith(t) or "no".startswith(t) for t in allowed)
    assert 0 < len(top) < 20  # forbidden tokens are left out, not reported at -inf
    assert math.isclose(sum(math.exp(lp) for _, lp in top), 1.0, rel_tol=1e-4)
    assert (token, logprob) == top[0]


def test_min_tokens_yield_to_a_complete_grammar(big_runner, backend):
    sched = scheduler(big_runner, backend)
    add(sched, "short", ask("Say yes."), regex="yes", min_new_tokens=6)
    req = drive(sched)["short"]
    assert req.finish_reason == FinishReason.STOP
    assert text(req) == "yes" and req.output_ids[-1] == 2


def test_retracted_constrained_requests_keep_their_grammar(big_runner, backend):
    """A pool of 12 pages cannot hold four growing requests: some are retracted and recomputed,
    and each output still validates and equals the output of a pool large enough for all."""
    schema = json.dumps(PERSON)
    prompts = {f"r{i}": ask(q) for i, q in enumerate(["A person?", "Someone in Rome?", "A friend?", "Me?"])}
    outputs = []
    for sched in (
        scheduler(make_runner(12 * 16), backend, new_token_reserve=1),
        scheduler(big_runner, backend),
    ):
        for rid, prompt in prompts.items():
            add(sched, rid, prompt, json_schema=schema)
        done = drive(sched)
        outputs.append({rid: req.output_ids for rid, req in done.items()})
        for req in done.values():
            jsonschema.validate(json.loads(text(req)), PERSON)
        if sched.runner is not big_runner:
            assert sched.metrics.retracted._value.get() > 0
    assert outputs[0] == outputs[1]


def test_bad_and_slow_grammars_fail_their_request_only(big_runner, backend):
    """A bad grammar and one whose own compile runs past the timeout fail their request (not
    retryable); one that only waited behind that compile fails as retryable (the compiler is busy);
    an unconstrained request runs."""
    sched = scheduler(big_runner, backend, grammar_compile_timeout=0.0)
    sched.add_request(Req("bad", ask("x"), SamplingParams(temperature=0.0, regex="(ab")))
    sched.grammar_future("bad").exception(timeout=120)
    slow = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"[a-z]{{{i}}}"}
                                             for i in range(40)}}  # fmt: skip
    slow_params = SamplingParams(temperature=0.0, json_schema=json.dumps(slow))
    waiting = {"slow": Req("slow", ask("x"), slow_params)}
    sched.add_request(waiting["slow"])
    while backend.compile_started(slow_params.grammar) is None:  # its compile holds the one worker
        time.sleep(0.001)
    waiting["queued"] = Req("queued", ask("x"), SamplingParams(temperature=0.0, regex="[0-9]{3}-queued"))
    sched.add_request(waiting["queued"])
    sched.add_request(Req("free", ask("Hi"), SamplingParams(temperature=0.0, max_new_tokens=4)))
    # what the servicers answer the gateway: 400 for the slow grammar, 429 (retry) for the one queued
    assert asyncio.run(grammar_error(sched, waiting["slow"]))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert asyncio.run(grammar_error(sched, waiting["queued"]))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    done = drive(sched)
    # a step failed them meanwhile: the servicers still answer with that error, not an ack
    assert asyncio.run(grammar_error(sched, done["bad"])) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        done["bad"].error,
    )
    assert asyncio.run(grammar_error(sched, done["queued"]))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert done["bad"].finish_reason == FinishReason.ERROR and "invalid regex" in done["bad"].error
    assert done["slow"].finish_reason == FinishReason.ERROR and "took longer than 0 s" in done["slow"].error
    assert done["queued"].finish_reason == FinishReason.ERROR and "compiler is busy" in done["queued"].error
    assert not done["bad"].retryable and not done["slow"].retryable and done["queued"].retryable
    assert done["free"].finish_reason == FinishReason.LENGTH


def test_a_scheduler_without_backend_refuses_grammars(big_runner):
    sched = Scheduler(big_runner, SchedulerConfig())
    with pytest.raises(ValueError, match="no grammar backend"):
        sched.add_request(Req("x", ask("x"), SamplingParams(regex="a")))
    assert not sched.has_work()


def test_a_prefill_worker_resumes_a_grammar_after_the_tokens_already_generated(big_runner, backend):
    """A request retracted on a decode worker is prefilled again with its generated tokens: the
    prefill worker's matcher accepts them first, so its token is the one the grammar allows next."""
    schema = json.dumps(PERSON)
    prompt = ask("Describe a person as JSON.")
    full = hf_constrained_greedy(prompt, 64, "json_schema", schema)
    sched = scheduler(big_runner, backend, role="prefill")
    for k in (0, 5, len(full) - 2):
        req = Req(
            f"resume-{k}", prompt, SamplingParams(temperature=0.0, json_schema=schema), output_ids=full[:k]
        )
        sched.add_request(req)
        sched.grammar_future(req.rid).exception(timeout=120)
        while not sched.decode.prefilled:
            batch = sched.schedule()
            sched.process_result(batch, sched.run_batch(batch))
        assert sched.pop_prefilled() == [req]
        assert req.output_ids == full[: k + 1]
        sched.prefill_sent(req.rid, ok=True)
    refused = Req("refused", prompt, SamplingParams(temperature=0.0, json_schema=schema), output_ids=[2])
    sched.add_request(refused)
    sched.grammar_future("refused").exception(timeout=120)
    assert sched.schedule() is None
    assert refused.finish_reason == FinishReason.ERROR and "not allowed by the grammar" in refused.error
    assert sched.ledger.used_pages() == 0
