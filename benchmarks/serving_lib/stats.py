"""Per-request measurements and their per-level summary (throughput, TTFT / ITL / TPOT / E2E percentiles).

The metric definitions follow the usual serving benchmarks (SGLang ``bench_serving``, vLLM
``benchmark_serving``): every latency is measured client-side from the streamed chunks.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

logger = logging.getLogger(__name__)

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    """What one streamed request measured; all times are seconds on ``time.perf_counter``'s clock.

    ``ttft`` is the time from sending to the first non-empty text chunk; ``itl`` the gaps between
    successive non-empty chunks (a chunk may carry several tokens); ``error`` is set (and the
    timings are meaningless) when the request failed. ``cached_tokens``: prompt tokens the server
    reported served from its prefix cache (0 where it reports none).
    """

    prompt_tokens: int
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None
    cached_tokens: int = 0

    @property
    def latency(self) -> float:
        """End-to-end latency in seconds."""
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, in seconds (None with fewer than two tokens)."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentiles(values: Sequence[float], ps: Iterable[int] = PERCENTILES) -> dict[str, float | None]:
    """``{"p50": v, ...}`` with linear interpolation between closest ranks (numpy's default method).

    Empty ``values`` give None for every percentile. Raises ValueError for a percentile outside 1..99.
    """
    ps = tuple(ps)
    if any(not 0 < p < 100 for p in ps):
        raise ValueError(f"percentiles must lie in 1..99, got {ps}")
    if not values:
        return {f"p{p}": None for p in ps}
    if len(values) == 1:
        return {f"p{p}": float(values[0]) for p in ps}
    cuts = statistics.quantiles(values, n=100, method="inclusive")  # cuts[k-1] is the k-th percentile
    return {f"p{p}": cuts[p - 1] for p in ps}


def _ms(values: Iterable[float]) -> dict[str, float | None]:
    pcts = percentiles([v * 1000.0 for v in values])
    return {k: None if v is None else round(v, 3) for k, v in pcts.items()}


@dataclass(slots=True)
class LevelResult:
    """Summary of one load level (one concurrency or one request rate) of one server configuration.

    Throughputs are over ``duration_s`` (first request sent to last response finished); latency
    percentiles are in milliseconds over the successful requests only; ``cached_share`` is the
    share of their prompt tokens the server served from its prefix cache.
    """

    label: str
    mode: str  # "concurrency" or "request_rate"
    level: float
    num_requests: int
    completed: int
    errors: int
    duration_s: float
    request_throughput: float
    input_throughput: float
    output_throughput: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    cached_share: float
    ttft_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    error_samples: list[str]
    # speculative decoding over the level (``spec_metrics.spec_summary``; empty without drafts)
    spec: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(label: str, mode: str, level: float, records: Sequence[RequestRecord]) -> LevelResult:
    """Fold one level's ``records`` into a :class:`LevelResult`.

    Raises ValueError if ``records`` is empty.
    """
    if not records:
        raise ValueError("no requests were run at this level")
    ok = [r for r in records if r.error is None]
    failed = [r for r in records if r.error is not None]
    for error, count in Counter(r.error for r in failed).most_common(3):
        logger.warning("%s %s level %s: %d request(s) failed: %s", label, mode, level, count, error)
    duration = max(r.end for r in records) - min(r.start for r in records)
    per_s = 1.0 / duration if duration > 0 else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return LevelResult(
        label=label,
        mode=mode,
        level=level,
        num_requests=len(records),
        completed=len(ok),
        errors=len(failed),
        duration_s=round(duration, 4),
        request_throughput=round(len(ok) * per_s, 4),
        input_throughput=round(in_tokens * per_s, 2),
        output_throughput=round(out_tokens * per_s, 2),
        mean_prompt_tokens=round(in_tokens / len(ok), 2) if ok else 0.0,
        mean_output_tokens=round(out_tokens / len(ok), 2) if ok else 0.0,
        cached_share=round(sum(r.cached_tokens for r in ok) / in_tokens, 4) if in_tokens else 0.0,
        ttft_ms=_ms(r.ttft for r in ok if r.ttft is not None),
        itl_ms=_ms(gap for r in ok for gap in r.itl),
        tpot_ms=_ms(t for r in ok if (t := r.tpot) is not None),
        e2e_ms=_ms(r.latency for r in ok),
        error_samples=sorted({r.error for r in failed})[:5],
    )
