"""A migrated request's continuation (``Req`` with resumed output ids, as the gateway resubmits it):
its tokens are the tail of the uninterrupted run, greedy and sampled, with every option that counts
output tokens (seeded sampler's step, penalties, min_new_tokens, logprobs); bad resumed ids are
refused at entry. On the real model, transport-free."""

from __future__ import annotations

import pytest

from pdserve.engine.model_runner import ModelRunner
from pdserve.sampling.bounds import BoundError
from tests.scheduler.driver import drive, fresh, ids, make_runner, req

CUT = 4  # output ids resumed by each continuation


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return make_runner(4096)


E = dict(ignore_eos=True)  # long enough to cut
REQUESTS = {
    "greedy": (ids("Write one sentence about the sea."), dict(max_new=12, **E)),
    "seeded": (ids("Name three colours:"), dict(max_new=10, temperature=0.9, top_p=0.9, seed=7, **E)),
    "top-k": (ids("Count:"), dict(max_new=8, temperature=1.2, top_k=5, seed=11, **E)),
    "penalised": (
        ids("Repeat after me: la la la"),
        dict(max_new=9, frequency_penalty=1.5, presence_penalty=0.5, **E),
    ),
    "repetition": (ids("Say it again and again:"), dict(max_new=9, repetition_penalty=1.3, **E)),
    "min-tokens": (ids("Hi"), dict(max_new=10, min_new_tokens=8)),
    "logprobs": (ids("Hello"), dict(max_new=8, return_logprob=True, top_logprobs_num=2, **E)),
}


def run(runner: ModelRunner, resumed: dict[str, list[int]] | None = None):
    sched = fresh(runner, role="mixed")
    for rid, (prompt, params) in REQUESTS.items():
        r = req(rid, prompt, **params)
        if resumed is not None:
            r.output_ids = list(resumed[rid])
        sched.add_request(r)
    return drive(sched, overlap=True)


def test_a_continuation_generates_the_tail_of_the_uninterrupted_run(runner):
    whole = run(runner)
    assert all(len(r.output_ids) > CUT for r in whole.values()), {k: r.output_ids for k, r in whole.items()}
    resumed = {rid: r.output_ids[:CUT] for rid, r in whole.items()}
    cont = run(runner, resumed)
    for rid, r in whole.items():
        assert cont[rid].output_ids == r.output_ids, rid
        assert cont[rid].finish_reason == r.finish_reason, rid
    # logprobs of the continuation's tokens are those of the same tokens in the whole run (to fp32
    # rounding: its first token's logits come from an extend over the resumed ids, not a decode step)
    got, want = cont["logprobs"].output_logprobs, whole["logprobs"].output_logprobs[CUT:]
    assert [(t, [i for i, _ in top]) for t, _, top in got] == [(t, [i for i, _ in top]) for t, _, top in want]
    flat = lambda rows: [lp for _, lp, top in rows for lp in (lp, *(v for _, v in top))]
    assert flat(got) == pytest.approx(flat(want), abs=1e-4)


@pytest.mark.parametrize(
    "resumed, message",
    [([1] * 12, "fewer than max_new_tokens"), ([49152], "must be token ids"), ([-1], "must be token ids")],
)
def test_bad_resumed_ids_are_refused_at_entry(runner, resumed, message):
    sched = fresh(runner, role="mixed")
    r = req("bad", ids("Hello"), max_new=12)
    r.output_ids = resumed
    with pytest.raises(BoundError, match=message):
        sched.add_request(r)
    assert not sched.has_work()


def test_a_continuation_must_fit_the_context(runner):
    sched = fresh(runner, role="mixed")
    context = sched.reqs.limits.context_len
    r = req("long", [1] * 8, max_new=context)
    r.output_ids = [2] * (context - 7)  # one over the context
    with pytest.raises(ValueError, match="context length"):
        sched.add_request(r)
