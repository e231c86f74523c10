"""Serving-benchmark output: the table, the side-by-side ratios, the JSON last line and the PNG plot."""

from __future__ import annotations

import json

import matplotlib.image as mpimg
import pytest

from benchmarks.serving import BenchConfig, report
from benchmarks.serving_lib.stats import RequestRecord, summarize


def level(label: str, concurrency: int, ttft: float, tokens: int):
    gaps = [0.5 / (tokens - 1)] * (tokens - 1)
    records = [
        RequestRecord(32, start=0.1 * i, end=0.1 * i + ttft + 0.5, ttft=ttft, itl=gaps, output_tokens=tokens)
        for i in range(4)
    ]
    return summarize(label, "concurrency", concurrency, records)


@pytest.fixture
def results():
    return [
        level("colocated", 1, 0.2, 16),
        level("colocated", 4, 0.4, 16),
        level("pd", 1, 0.1, 16),
        level("pd", 4, 0.3, 24),
    ]


def test_json_is_the_last_stdout_line(results, capsys, tmp_path):
    runs = [{"label": "colocated", "base_url": "http://a/v1"}, {"label": "pd", "base_url": "http://b/v1"}]
    cfg = BenchConfig(levels=[1, 4])
    returned = report(results, runs, cfg, str(tmp_path / "deep" / "plot.png"))

    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    doc = json.loads(lines[-1])
    assert doc == returned
    assert doc["base_url"] == "http://a/v1"
    assert doc["runs"] == runs
    assert doc["config"]["levels"] == [1, 4] and doc["config"]["output_tokens"] == 64
    labels_levels = [(lv["label"], lv["level"]) for lv in doc["levels"]]
    assert labels_levels == [("colocated", 1), ("colocated", 4), ("pd", 1), ("pd", 4)]
    for lv, r in zip(doc["levels"], results, strict=True):
        assert lv["output_throughput"] == r.output_throughput
        assert set(lv["ttft_ms"]) == set(lv["itl_ms"]) == set(lv["e2e_ms"]) == {"p50", "p90", "p99"}

    # ratios to the first label at the same level, computed here from the summaries
    pd4 = next(c for c in doc["comparison"] if c["label"] == "pd" and c["level"] == 4)
    assert pd4["baseline"] == "colocated"
    expected = results[3].output_throughput / results[1].output_throughput
    assert pd4["output_throughput_ratio"] == pytest.approx(expected, abs=1e-3)
    assert pd4["ttft_p50_ratio"] == pytest.approx(300 / 400, abs=1e-3)

    # the table: a header, a rule, one row per (label, level), with the ratio column
    table_lines = lines[:-1]
    assert "tput x colocated" in table_lines[0]
    assert len(table_lines) == 2 + len(results)


def test_single_label_has_no_comparison(results, capsys):
    doc = report(results[:2], [{"label": "colocated", "base_url": "http://a/v1"}], BenchConfig(), None)
    assert doc["comparison"] == []
    assert "tput x" not in capsys.readouterr().out


def test_plot_is_a_png(results, tmp_path, capsys):
    path = tmp_path / "out" / "serving.png"
    report(results, [], BenchConfig(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = mpimg.imread(path).shape
    assert width > height > 100
