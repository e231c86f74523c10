"""Load patterns of the serving benchmark: the concurrency cap and the Poisson arrival schedule."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from benchmarks.serving_lib.load import poisson_offsets, run_level
from benchmarks.serving_lib.stats import RequestRecord


class Recorder:
    """A request that takes ``delay`` seconds and notes how many were in flight and when it started."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.in_flight = 0
        self.peak = 0
        self.started: dict[int, float] = {}

    async def __call__(self, item: int) -> RequestRecord:
        self.started[item] = time.perf_counter()
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        return RequestRecord(prompt_tokens=item, start=self.started[item], end=time.perf_counter())


@pytest.mark.parametrize(("concurrency", "items"), [(1, 5), (4, 17), (16, 6)])
async def test_fixed_concurrency_caps_requests_in_flight(concurrency, items):
    send = Recorder(0.01)
    records = await run_level(send, list(range(items)), "concurrency", concurrency)
    assert [r.prompt_tokens for r in records] == list(range(items))  # one record per item, in order
    assert send.peak == min(concurrency, items)
    assert send.in_flight == 0


def test_poisson_offsets_have_the_asked_rate():
    offsets = poisson_offsets(4000, rate=8.0, seed=3)
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert offsets[0] == 0.0
    assert all(g > 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 8.0, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 8.0, rel=0.1)  # exponential: sd == mean
    assert poisson_offsets(50, 8.0, seed=3) == offsets[:50]
    with pytest.raises(ValueError):
        poisson_offsets(3, 0.0, seed=0)


async def test_poisson_requests_start_on_schedule():
    send = Recorder(0.05)
    items = list(range(12))
    begin = time.perf_counter()
    await run_level(send, items, "request_rate", 40.0, seed=9)
    expected = poisson_offsets(len(items), 40.0, seed=9)
    late = [send.started[i] - begin - expected[i] for i in items]
    assert all(-0.005 <= d < 0.1 for d in late), late
    assert send.peak > 1  # open loop: arrivals do not wait for earlier requests


async def test_unknown_mode_raises():
    with pytest.raises(ValueError):
        await run_level(Recorder(0.0), [1], "closed", 1)  # type: ignore[arg-type]
