"""Load patterns: a fixed number of requests in flight (closed loop) or Poisson arrivals (open loop)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal, TypeVar

from tqdm.auto import tqdm

from benchmarks.serving_lib.stats import RequestRecord

T = TypeVar("T")
Send = Callable[[T], Awaitable[RequestRecord]]
LoadMode = Literal["concurrency", "request_rate"]


async def run_fixed_concurrency(
    send: Send[T], items: Sequence[T], concurrency: int, bar: tqdm
) -> list[RequestRecord]:
    """Send every item, keeping ``min(concurrency, len(items))`` requests in flight until the queue drains.

    Returns the records in the order of ``items``. Raises ValueError if ``concurrency < 1``.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    records: list[RequestRecord | None] = [None] * len(items)
    queue = iter(enumerate(items))

    async def worker() -> None:
        for i, item in queue:  # the shared iterator hands each item to exactly one worker
            records[i] = await send(item)
            bar.update()

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(items)))))
    return records  # type: ignore[return-value]


def poisson_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of ``count`` Poisson arrivals at ``rate`` requests/s.

    The first request goes at 0; the gaps are exponential with mean ``1 / rate``.
    Raises ValueError if ``rate <= 0``.
    """
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(count):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


async def run_poisson(
    send: Send[T], items: Sequence[T], rate: float, seed: int, bar: tqdm
) -> list[RequestRecord]:
    """Send item ``i`` at the ``i``-th Poisson arrival time, with no cap on requests in flight."""
    start = time.perf_counter()

    async def at(offset: float, item: T) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        record = await send(item)
        bar.update()
        return record

    offsets = poisson_offsets(len(items), rate, seed)
    return list(await asyncio.gather(*(at(o, item) for o, item in zip(offsets, items, strict=True))))


async def run_level(
    send: Send[T], items: Sequence[T], mode: LoadMode, level: float, seed: int = 0, desc: str = ""
) -> list[RequestRecord]:
    """Run one load level with a progress bar (on stderr) and return one record per item.

    ``level`` is the concurrency (``mode="concurrency"``) or the request rate in requests/s
    (``mode="request_rate"``). Raises ValueError for an unknown mode.
    """
    with tqdm(total=len(items), desc=desc, unit="req", leave=False, dynamic_ncols=True) as bar:
        if mode == "concurrency":
            return await run_fixed_concurrency(send, items, int(level), bar)
        if mode == "request_rate":
            return await run_poisson(send, items, level, seed, bar)
    raise ValueError(f"unknown load mode {mode!r}")
