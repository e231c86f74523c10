"""The ``priority`` workload: a high-priority request's TTFT under a saturating low-priority load,
against the same request's TTFT on the idle server (issue 41's target: within 2x).

Idle phase: ``probes`` high-priority requests, one at a time, nothing else running. Loaded phase:
``load`` low-priority streams, each sending its next request as soon as its last one ends (so with
``load`` above the server's ``--max-running-requests`` its waiting queue never empties), and the
same number of high-priority probes, one every ``probe_interval_s`` seconds once the load runs.
The server must run ``--schedule-policy priority`` (lower priority values are served first, and
may preempt); to see the same load without priorities, run with both priorities 0 against
``--schedule-policy fcfs``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

from benchmarks.serving_lib.client import CompletionTarget, stream_completion
from benchmarks.serving_lib.stats import RequestRecord, percentiles


@dataclasses.dataclass(frozen=True, slots=True)
class PriorityLoad:
    """The loaded phase: ``load`` low-priority streams at ``low``, ``probes`` probes at ``high``."""

    load: int = 32
    probes: int = 8
    probe_interval_s: float = 1.0
    high: int = -10
    low: int = 10


async def bench_priority(
    target: CompletionTarget, prompts: Callable[[int], Awaitable[list[tuple[str, int]]]], spec: PriorityLoad
) -> dict:
    """Run both phases; returns idle and loaded probe TTFTs (seconds, p50 / p90), their ratios, the
    low-priority requests served during the loaded phase and the errors of each kind.

    ``prompts(n)``: n fresh ``(prompt, prompt_tokens)`` items.
    """
    high = dataclasses.replace(target, priority=spec.high)
    low = dataclasses.replace(target, priority=spec.low)
    idle = [await stream_completion(high, *item) for item in await prompts(spec.probes)]
    stop = asyncio.Event()
    served: list[RequestRecord] = []

    async def stream(items: list[tuple[str, int]]) -> None:
        for item in items:
            if stop.is_set():
                return
            served.append(await stream_completion(low, *item))

    per_stream = 4 + int(spec.probes * spec.probe_interval_s)
    streams = [asyncio.create_task(stream(await prompts(per_stream))) for _ in range(spec.load)]
    loaded: list[RequestRecord] = []
    for item in await prompts(spec.probes):
        await asyncio.sleep(spec.probe_interval_s)
        loaded.append(await stream_completion(high, *item))
    stop.set()
    await asyncio.gather(*streams)
    idle_ttft = percentiles([r.ttft for r in idle if r.ttft is not None], (50, 90))
    loaded_ttft = percentiles([r.ttft for r in loaded if r.ttft is not None], (50, 90))
    ratio = {p: _ratio(loaded_ttft[p], idle_ttft[p]) for p in idle_ttft}
    return {
        "idle_ttft_s": idle_ttft,
        "loaded_ttft_s": loaded_ttft,
        "loaded_over_idle": ratio,
        "low_priority_served": sum(r.error is None for r in served),
        "errors": {
            "probe": sum(r.error is not None for r in idle + loaded),
            "load": sum(r.error is not None for r in served),
        },
        "first_error": next((r.error for r in idle + loaded + served if r.error), None),
    }


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else round(value / base, 3)


def priority_table(label: str, spec: PriorityLoad, result: dict) -> str:
    """One row per phase: probe TTFT p50 / p90 in ms, and the loaded phase's ratio to idle."""
    rows = [f"{'run':<12} {'phase':<8} {'probe TTFT p50 ms':>18} {'p90 ms':>8} {'x idle p50':>10}"]
    for phase, key in (("idle", "idle_ttft_s"), (f"load={spec.load}", "loaded_ttft_s")):
        p50, p90 = (result[key][p] for p in ("p50", "p90"))
        ratio = result["loaded_over_idle"]["p50"] if key == "loaded_ttft_s" else 1.0
        ms = [f"{v * 1000:.1f}" if v is not None else "-" for v in (p50, p90)]
        rows.append(
            f"{label:<12} {phase:<8} {ms[0]:>18} {ms[1]:>8} {ratio if ratio is not None else '-':>10}"
        )
    return "\n".join(rows)
