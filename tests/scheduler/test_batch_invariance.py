"""Batch invariance of the whole engine, in process: a request's greedy tokens and their logprobs (and
top logprobs) are the same bit for bit alone, among 1, 7 and 63 other requests of other lengths,
arriving while others decode, after a radix-cache hit, and with its prompt chunked at other sizes,
in the overlapped loop's order too; and a seeded sampled request gives the same tokens alone and
batched. On this CPU's default configuration (``--dtype auto --quantization auto``) and on
bfloat16 named explicitly (unquantized).

What makes it hold: every matmul computes a row alike whatever the batch (one kernel family per
weight format for every batch size, K summed in a fixed order; W4A8's AMX tiles and VNNI give the
same integer sums), every token's attention is a row of the one paged kernel (a decoding token and
a token of a prefill, a chunk or a cache hit alike, keys split at fixed positions), and the fused
row ops, the LM head and the sampler work a row at a time.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.model_source import resolve_model
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.req import Req
from tests.scheduler.driver import PAGE, drive, fresh, ids

NEW = 16
NO_QUEUE_LIMIT = {"max_queue_time": 0}  # a loaded machine's slow steps are no reason to abort a probe
TEXTS = (
    "Hi",
    "Write one sentence about the sea.",
    "The history of the printing press begins with movable type in East Asia and continues in Europe.",
    " ".join(["Summarize: the quick brown fox jumps over the lazy dog near the old river bank."] * 12),
)


@pytest.fixture(scope="module", params=["auto", "bfloat16"])
def runner(request) -> ModelRunner:
    """The default configuration of this CPU (dtype and quantization auto), or unquantized bfloat16."""
    torch.set_num_threads(2)
    return ModelRunner(
        resolve_model(), dtype=request.param, quantization="auto", page_size=PAGE, max_total_tokens=16384
    )


def probe(rid: str, prompt: list[int], **params) -> Req:
    sampling = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True, "return_logprob": True}
    sampling["top_logprobs_num"] = 3
    return Req(rid, list(prompt), SamplingParams(**(sampling | params)))


def fillers(count: int, seed: int) -> list[Req]:
    """``count`` other requests: random prompts of 3 to 300 tokens, 2 to 24 new tokens each."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 300, (count,), generator=gen).tolist()
    news = torch.randint(2, 24, (count,), generator=gen).tolist()
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in lengths]
    pairs = enumerate(zip(prompts, news, strict=True))
    return [Req(f"f{i}", prompt, SamplingParams(max_new_tokens=m)) for i, (prompt, m) in pairs]


def outputs(req: Req) -> tuple:
    """What a client sees of a request: its tokens and their logprobs and top logprobs."""
    return req.output_ids, req.output_logprobs


def run(runner: ModelRunner, reqs: list[Req], late: list[Req] = (), overlap: bool = False, **config) -> None:
    """``reqs`` from the start and ``late`` once the others have decoded a few steps, to the end."""
    sched = fresh(runner, role="mixed", **(NO_QUEUE_LIMIT | config))
    for r in reqs:
        sched.add_request(r)

    def add_late(step: int, scheduler) -> None:
        if step == 4:
            for r in late:
                scheduler.add_request(r)

    drive(sched, overlap=overlap, on_step=add_late)


@pytest.fixture(scope="module")
def alone(runner) -> dict[str, tuple]:
    """Each probe run by itself, on a cold cache, its prompt in one piece."""
    result = {}
    for i, text in enumerate(TEXTS):
        r = probe(f"p{i}", ids(text))
        run(runner, [r])
        assert len(r.output_ids) == NEW and len(r.output_logprobs) == NEW
        result[r.rid] = outputs(r)
    return result


def probes() -> list[Req]:
    return [probe(f"p{i}", ids(text)) for i, text in enumerate(TEXTS)]


def assert_same(reqs: list[Req], alone: dict[str, tuple]) -> None:
    for r in reqs:
        assert outputs(r) == alone[r.rid], r.rid


def test_among_one_other_request(runner, alone):
    for i, r in enumerate(probes()):
        run(runner, [r, *fillers(1, seed=i)])
        assert_same([r], alone)


@pytest.mark.parametrize("others", [7, 63])
def test_among_other_requests_of_other_lengths(runner, alone, others):
    reqs = probes()
    run(runner, reqs + fillers(others + 1 - len(reqs), seed=others))
    assert_same(reqs, alone)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_arriving_while_others_decode(runner, alone, overlap):
    reqs = probes()
    run(runner, fillers(12, seed=5), late=reqs, overlap=overlap)
    assert_same(reqs, alone)


def test_after_a_radix_cache_hit(runner, alone):
    """The second run of each prompt extends only its uncached suffix (a page-aligned prefix is
    cached), in a batch with other requests."""
    sched = fresh(runner, role="mixed", **NO_QUEUE_LIMIT)
    first = probes()
    for r in first:
        sched.add_request(r)
    drive(sched)
    second = probes()
    for r in [*second, *fillers(5, seed=6)]:
        sched.add_request(r)
    drive(sched)
    assert any(r.cached_tokens > 0 for r in second)
    assert_same(first + second, alone)


@pytest.mark.parametrize("chunk", [16, 48])
def test_with_the_prompt_chunked(runner, alone, chunk):
    reqs = probes()
    run(runner, reqs + fillers(3, seed=chunk), chunked_prefill_size=chunk)
    assert_same(reqs, alone)


def test_seeded_sampling_alone_and_batched(runner):
    params = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    lone = probe("s", ids(TEXTS[2]), **params)
    run(runner, [lone])
    batched = probe("s", ids(TEXTS[2]), **params)
    run(runner, [*fillers(9, seed=7), batched])
    assert outputs(batched) == outputs(lone)
