"""The gateway-overhead benchmark's in-process side: the colocated scheduler built from launch flags and
driven without any transport; and the overhead summary.

Greedy outputs of a concurrent run are checked against the same scheduler driven one request at a time
through its own API (tests/scheduler checks that against HF transformers; loading the HF reference here
would cost ~25 s).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from benchmarks.serving_lib.in_process import InProcessServer
from benchmarks.serving_lib.load import run_level
from benchmarks.serving_lib.overhead import (
    HTTP,
    IN_PROCESS,
    SideRun,
    latency_totals,
    overhead_table,
    summarize_overhead,
)
from benchmarks.serving_lib.stats import RequestRecord, summarize
from benchmarks.serving_lib.workload import PromptSource
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.req import Req
from pdserve.scheduler.scheduler import Scheduler
from tests.reference import hf_tokenizer

PAGE, POOL, MAX_RUNNING, CHUNK = 32, 2048, 8, 64
FLAGS = (
    "--colocated", "--dtype", "float32", "--page-size", str(PAGE), "--max-total-tokens", str(POOL),
    "--max-running-requests", str(MAX_RUNNING), "--chunked-prefill-size", str(CHUNK),
    # one token per step, so that the driver times one gap per token (a speculative step's tokens
    # arrive together: one gap per step)
    "--speculative-algorithm", "none",
)  # fmt: skip
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def server() -> InProcessServer:
    with ThreadPoolExecutor(1) as pool:  # a short-lived thread, as from_launch_flags asks
        return pool.submit(InProcessServer.from_launch_flags, FLAGS).result()


def test_the_launch_flags_reach_the_scheduler(server):
    sched = server.scheduler
    assert sched.role == "mixed" and sched.page_size == PAGE
    assert sched.usable_pages == POOL // PAGE
    assert sched.config.max_running_requests == MAX_RUNNING
    assert sched.config.chunked_prefill_size == CHUNK
    assert str(sched.runner.model_config.dtype) == "torch.float32"
    # the decode service's default: no overlap where the forward's threads take every core
    assert server.overlap == (torch.get_num_threads() < len(os.sched_getaffinity(0)))
    with pytest.raises(ValueError, match="--colocated"):
        InProcessServer.from_launch_flags(["--num-prefill", "1"])


def test_enable_overlap_schedule_reaches_the_loop():
    with ThreadPoolExecutor(1) as pool:
        flags = [*FLAGS, "--enable-overlap-schedule"]
        overlapped = pool.submit(InProcessServer.from_launch_flags, flags).result()
    assert overlapped.overlap


def alone(sched: Scheduler, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """Tokens of ``prompt`` run alone through the scheduler's own step API (no loop, no driver)."""
    req = Req(rid, list(prompt), params)
    sched.add_request(req)
    while not req.state.done:
        batch = sched.schedule()
        sched.process_result(batch, sched.run_batch(batch))
    return req.output_ids


async def test_fixed_concurrency_run_gives_every_token_and_the_greedy_output(server):
    texts = PromptSource("random", 40, 1, seed=3).take(3)
    prompts = [hf_tokenizer()(t)["input_ids"] for t in texts]  # 40+ tokens: the 64-token chunk splits two
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    expected = [alone(server.scheduler, f"alone-{i}", p, params) for i, p in enumerate(prompts)]
    outputs: dict[int, list[int]] = {}

    async def send(i: int) -> RequestRecord:
        generation = await server.generate(prompts[i], params)
        outputs[i] = generation.output_ids
        return generation.record

    before = latency_totals(server.scheduler.metrics.text())
    async with server:
        records = await run_level(send, range(len(prompts)), "concurrency", 2)
    after = latency_totals(server.scheduler.metrics.text())
    result = summarize(IN_PROCESS, "concurrency", 2, records)
    # the scheduler timed one first token and NEW_TOKENS - 1 gaps per request, as the driver did
    assert after["ttft_count"] - before["ttft_count"] == len(prompts)
    assert after["itl_count"] - before["itl_count"] == len(prompts) * (NEW_TOKENS - 1)
    assert (result.completed, result.errors) == (3, 0)
    assert result.mean_prompt_tokens == pytest.approx(sum(map(len, prompts)) / 3, abs=0.01)
    for i, record in enumerate(records):
        assert record.output_tokens == NEW_TOKENS and len(outputs[i]) == NEW_TOKENS
        assert len(record.itl) == NEW_TOKENS - 1 and 0 < record.ttft < record.latency
        assert outputs[i] == expected[i], i
    sched = server.scheduler
    assert not sched.has_work() and sched.ledger.used_pages() == 0
    sched.check_invariants()


async def test_a_request_the_pool_cannot_hold_is_an_error_record(server):
    params = SamplingParams(temperature=0.0, max_new_tokens=2)
    with pytest.raises(RuntimeError):
        await server.generate([1, 2, 3], params)
    async with server:
        generation = await server.generate([42] * (POOL + PAGE), params)
    assert generation.record.error and "KV pages" in generation.record.error
    assert generation.output_ids == [] and generation.record.ttft is None


def _run(label: str, rnd: int, level: int, seconds: float, requests: int, tokens: int) -> SideRun:
    records = [
        RequestRecord(prompt_tokens=10, start=0.0, end=seconds, ttft=0.1, output_tokens=tokens)
        for _ in range(requests)
    ]
    return SideRun(
        rnd, summarize(label, "concurrency", level, records), {"bench": 1.0}, {"ttft": 1, "itl": 2}
    )


def test_overhead_ratio_sums_tokens_and_seconds_over_rounds():
    runs = [
        _run(HTTP, 0, 4, 10.0, 4, 50),  # 20 tok/s
        _run(IN_PROCESS, 0, 4, 8.0, 4, 50),  # 25 tok/s
        _run(IN_PROCESS, 1, 4, 5.0, 4, 50),  # 40 tok/s
        _run(HTTP, 1, 4, 6.0, 4, 50),  # 33.3 tok/s
    ]
    [row] = summarize_overhead(runs)
    http_tps, local_tps = 400 / 16.0, 400 / 13.0
    assert row["http_tok_s"] == pytest.approx(http_tps, abs=0.01)
    assert row["in_process_tok_s"] == pytest.approx(local_tps, abs=0.01)
    assert row["ratio"] == pytest.approx(http_tps / local_tps, abs=1e-3)
    assert row["round_ratios"] == pytest.approx([20 / 25, (200 / 6) / 40], abs=1e-3)
    assert row["meets_target"] is (http_tps / local_tps >= 0.9)
    assert "cpu s bench" in overhead_table(runs, [row])
