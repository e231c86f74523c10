"""Serving-benchmark output: the table, the side-by-side ratios, the JSON last line and the PNG plot."""

from __future__ import annotations

import json

import matplotlib.image as mpimg
import pytest

from benchmarks.serving import BenchConfig, report
from benchmarks.serving_lib.report import rounds
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


def test_rounds_give_medians_and_the_median_ratio_of_neighbours(capsys):
    """``--repeat``: labels ``NAME#k``; per name and level the median throughput over the rounds and the
    median of each round's ratio to the first name's (the machine drifting: round 2 ran 2x slower)."""
    results = [
        level("a#1", 1, 0.2, 16),
        level("b#1", 1, 0.1, 16),
        level("a#2", 1, 0.4, 16),
        level("b#2", 1, 0.3, 16),
        level("a#3", 1, 0.2, 16),
        level("b#3", 1, 0.2, 16),
    ]
    doc = report(
        results, [{"label": r.label, "base_url": "http://a/v1"} for r in results], BenchConfig(), None
    )
    tput = {r.label: r.output_throughput for r in results}
    b = next(row for row in doc["rounds"] if row["label"] == "b")
    assert b["baseline"] == "a" and b["rounds"] == 3
    assert b["output_throughput_median"] == pytest.approx(
        sorted(tput[f"b#{k}"] for k in (1, 2, 3))[1], abs=0.01
    )
    ratios = sorted(tput[f"b#{k}"] / tput[f"a#{k}"] for k in (1, 2, 3))
    assert b["output_throughput_ratio_median"] == pytest.approx(ratios[1], abs=1e-3)
    assert b["output_throughput_min"] == pytest.approx(min(tput[f"b#{k}"] for k in (1, 2, 3)), abs=0.01)
    assert next(row for row in doc["rounds"] if row["label"] == "a")["output_throughput_ratio_median"] == 1.0
    assert "medians over the rounds" in capsys.readouterr().out


def test_round_labels_keep_a_suffix_and_plain_labels_have_no_rounds():
    assert [
        row["label"] for row in rounds([level("a#1 lora4", 1, 0.2, 16), level("a#2 lora4", 1, 0.2, 16)])
    ] == ["a lora4"]
    assert rounds([level("a#1", 1, 0.2, 16), level("b", 1, 0.2, 16)]) == []
