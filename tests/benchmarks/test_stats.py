"""Serving-benchmark statistics: percentiles against numpy, and the per-level summary on known records."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.serving_lib.stats import RequestRecord, percentiles, summarize

KNOWN_SAMPLES = [
    [3.0, 1.0, 2.0],
    [10.0, 20.0],
    list(range(1, 101)),
    [0.5, 0.5, 0.5, 7.25, 100.0, 2.0, 3.5],
]


@pytest.mark.parametrize("values", KNOWN_SAMPLES)
def test_percentiles_match_numpy_linear(values):
    got = percentiles(values, (1, 25, 50, 90, 99))
    for p in (1, 25, 50, 90, 99):
        assert got[f"p{p}"] == pytest.approx(np.percentile(values, p))


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=200))
def test_percentiles_match_numpy_on_any_sample(values):
    got = percentiles(values)
    for p in (50, 90, 99):
        assert got[f"p{p}"] == pytest.approx(np.percentile(values, p), rel=1e-9, abs=1e-9)


def test_percentiles_empty_and_out_of_range():
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    with pytest.raises(ValueError):
        percentiles([1.0, 2.0], (0, 50))
    with pytest.raises(ValueError):
        percentiles([1.0, 2.0], (100,))


def _record(start, ttft, gaps, tokens, prompt=100, error=None, cached=0):
    end = start + ttft + sum(gaps)
    return RequestRecord(prompt, start, end, ttft, list(gaps), tokens, error, cached)


def test_summarize_known_records():
    ok = [
        _record(0.0, 0.10, [0.02, 0.03, 0.05], 4, prompt=120),
        _record(0.05, 0.20, [0.04, 0.04], 3, prompt=80, cached=64),
        _record(0.30, 0.15, [0.01] * 9, 10, prompt=100),
    ]
    failed = RequestRecord(100, 0.1, 0.2, error="APIConnectionError: refused")
    result = summarize("cfg", "concurrency", 16, [*ok, failed])

    duration = max(r.end for r in [*ok, failed]) - min(r.start for r in [*ok, failed])
    assert (result.num_requests, result.completed, result.errors) == (4, 3, 1)
    assert result.error_samples == ["APIConnectionError: refused"]
    assert result.duration_s == pytest.approx(duration, abs=1e-4)
    assert result.output_throughput == pytest.approx(17 / duration, rel=1e-3)
    assert result.input_throughput == pytest.approx(300 / duration, rel=1e-3)
    assert result.request_throughput == pytest.approx(3 / duration, rel=1e-3)
    assert result.mean_output_tokens == pytest.approx(17 / 3, abs=0.01)
    assert result.cached_share == pytest.approx(64 / 300, abs=1e-4)  # of the completed requests' prompts

    ttfts = np.array([0.10, 0.20, 0.15]) * 1000
    gaps = np.array([0.02, 0.03, 0.05, 0.04, 0.04] + [0.01] * 9) * 1000
    e2e = np.array([r.end - r.start for r in ok]) * 1000
    tpot = np.array([(r.end - r.start - r.ttft) / (r.output_tokens - 1) for r in ok]) * 1000
    for p in (50, 90, 99):
        assert result.ttft_ms[f"p{p}"] == pytest.approx(np.percentile(ttfts, p), abs=1e-3)
        assert result.itl_ms[f"p{p}"] == pytest.approx(np.percentile(gaps, p), abs=1e-3)
        assert result.e2e_ms[f"p{p}"] == pytest.approx(np.percentile(e2e, p), abs=1e-3)
        assert result.tpot_ms[f"p{p}"] == pytest.approx(np.percentile(tpot, p), abs=1e-3)


def test_summarize_all_failed_and_empty():
    result = summarize("x", "request_rate", 2.0, [RequestRecord(10, 0.0, 1.0, error="boom")])
    assert (result.completed, result.errors, result.output_throughput) == (0, 1, 0.0)
    assert result.ttft_ms["p50"] is None
    with pytest.raises(ValueError):
        summarize("x", "concurrency", 1, [])
