"""Results out: the printed table, the side-by-side ratios, the final JSON line and the PNG plot."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from statistics import median

from tabulate import tabulate

from benchmarks.serving_lib.stats import LevelResult

MODE_AXIS = {"concurrency": "concurrency", "request_rate": "request rate (req/s)"}
ROUND = "#"  # labels "NAME#k": round k of configuration NAME (``--repeat``)


def _ratio(value: float | None, base: float | None) -> float | None:
    return round(value / base, 3) if value is not None and base else None


def comparison(results: Sequence[LevelResult]) -> list[dict]:
    """Each result's output throughput, TTFT p50 and ITL p50 divided by the first label's at the same level.

    The first label in ``results`` is the baseline; levels it did not run are left out.
    """
    if not results:
        return []
    baseline = results[0].label
    base = {(r.mode, r.level): r for r in results if r.label == baseline}
    rows = []
    for r in results:
        b = base.get((r.mode, r.level))
        if b is None:
            continue
        rows.append(
            {
                "label": r.label,
                "baseline": baseline,
                "mode": r.mode,
                "level": r.level,
                "output_throughput_ratio": _ratio(r.output_throughput, b.output_throughput),
                "ttft_p50_ratio": _ratio(r.ttft_ms["p50"], b.ttft_ms["p50"]),
                "itl_p50_ratio": _ratio(r.itl_ms["p50"], b.itl_ms["p50"]),
            }
        )
    return rows


def rounds(results: Sequence[LevelResult]) -> list[dict]:
    """Configurations run in rounds (``--repeat``: labels ``NAME#k``, every configuration once a round,
    in turn): per name and level, the median over rounds of the output throughput (and the rounds'
    min and max), of its ratio to the first name's in the same round, and of ITL p50. A ratio of
    neighbours is what to read on a noisy machine: a drift across a long run moves both alike.

    Returns [] unless every label names a round.
    """
    runs: dict[tuple[str, str, float], dict[int, LevelResult]] = {}
    for r in results:
        name, k = _round_of(r.label)
        if k is None:
            return []
        runs.setdefault((name, r.mode, r.level), {})[k] = r
    baseline = _round_of(results[0].label)[0] if results else ""
    rows = []
    for (name, mode, level), by_round in runs.items():
        base = runs.get((baseline, mode, level), {})
        tput = [r.output_throughput for r in by_round.values()]
        ratios = [
            r.output_throughput / base[k].output_throughput
            for k, r in by_round.items()
            if k in base and base[k].output_throughput
        ]
        itl = [r.itl_ms["p50"] for r in by_round.values() if r.itl_ms["p50"] is not None]
        rows.append(
            {
                "label": name,
                "baseline": baseline,
                "mode": mode,
                "level": level,
                "rounds": len(by_round),
                "output_throughput_median": round(median(tput), 2),
                "output_throughput_min": round(min(tput), 2),
                "output_throughput_max": round(max(tput), 2),
                "output_throughput_ratio_median": round(median(ratios), 3) if ratios else None,
                "itl_p50_median": round(median(itl), 2) if itl else None,
            }
        )
    return rows


def round_label(label: str, k: int, repeat: int) -> str:
    """The label of round ``k`` of ``repeat`` of configuration ``label`` (``label`` itself when it
    runs once)."""
    return f"{label}{ROUND}{k}" if repeat > 1 else label


def _round_of(label: str) -> tuple[str, int | None]:
    """(configuration, round) of a label ``round_label`` made, a suffix after it kept (``lora4``)."""
    found = re.fullmatch(rf"(.*){ROUND}(\d+)(.*)", label)
    return (found[1] + found[3], int(found[2])) if found else (label, None)


def rounds_table(rows: Sequence[dict]) -> str:
    """:func:`rounds` as a table: one row per (name, level)."""
    baseline = rows[0]["baseline"]
    headers = ["label", "mode", "level", "rounds", "out tok/s median", "min", "max"]
    headers += [f"median tput x {baseline}", "ITL p50 median"]
    keys = ["label", "mode", "level", "rounds", "output_throughput_median", "output_throughput_min"]
    keys += ["output_throughput_max", "output_throughput_ratio_median", "itl_p50_median"]
    ordered = sorted(rows, key=lambda r: (r["mode"], r["level"]))
    body = [[row[k] for k in keys] for row in ordered]
    return tabulate(body, headers=headers, floatfmt=["", "", "g", "", ".1f", ".1f", ".1f", ".3f", ".1f"])


def table(results: Sequence[LevelResult]) -> str:
    """One row per (label, level): counts, throughputs and TTFT / ITL / E2E p50/p90/p99 in ms (and
    the cached share of prompt tokens where a server reported cache hits).

    With more than one label, a ``tput x`` column gives the output-throughput ratio to the first label.
    """
    labels = list(dict.fromkeys(r.label for r in results))
    ratios = {(c["label"], c["mode"], c["level"]): c["output_throughput_ratio"] for c in comparison(results)}
    headers = ["label", "mode", "level", "ok", "err", "req/s", "out tok/s"]
    floatfmt = ["", "", "g", "", "", ".2f", ".1f"]
    if len(labels) > 1:
        headers.append(f"tput x {labels[0]}")
        floatfmt.append(".2f")
    for metric in ("TTFT", "ITL", "E2E"):
        headers += [f"{metric} p50", f"{metric} p90", f"{metric} p99"]
        floatfmt += [".1f"] * 3
    caches = any(r.cached_share for r in results)
    if caches:  # the share of prompt tokens served from the prefix cache
        headers.append("cached")
        floatfmt.append(".3f")
    speculates = any(r.spec for r in results)
    if speculates:  # speculative decoding: acceptance rate and mean accepted length per drafting step
        headers += ["accept", "acc len"]
        floatfmt += [".2f", ".2f"]
    rows = []
    for r in sorted(results, key=lambda r: (r.mode, r.level, labels.index(r.label))):
        row = [r.label, r.mode, r.level, r.completed, r.errors, r.request_throughput, r.output_throughput]
        if len(labels) > 1:
            row.append(ratios.get((r.label, r.mode, r.level)))
        for pcts in (r.ttft_ms, r.itl_ms, r.e2e_ms):
            row += [pcts["p50"], pcts["p90"], pcts["p99"]]
        if caches:
            row.append(r.cached_share)
        if speculates:
            row += [r.spec.get("acceptance_rate"), r.spec.get("mean_accepted_len")]
        rows.append(row)
    return tabulate(rows, headers=headers, floatfmt=floatfmt, missingval="-")


def json_line(results: Sequence[LevelResult], runs: Sequence[dict], config: dict) -> str:
    """The one-line JSON document that ends stdout.

    Keys: ``base_url`` (the first run's), ``runs`` (``{"label", "base_url", "launch"}`` each),
    ``config`` (the benchmark settings), ``levels`` (every :class:`LevelResult` as a dict, with its
    ``label``), ``comparison`` (:func:`comparison`, empty with a single label) and ``rounds``
    (:func:`rounds`, empty unless ``--repeat``).
    """
    labels = {r.label for r in results}
    doc = {
        "base_url": runs[0]["base_url"] if runs else None,
        "runs": list(runs),
        "config": config,
        "levels": [r.to_dict() for r in results],
        "comparison": comparison(results) if len(labels) > 1 else [],
        "rounds": rounds(results),
    }
    return json.dumps(doc, separators=(",", ":"))


def plot(results: Sequence[LevelResult], path: str | Path) -> Path:
    """Save output throughput (left) and TTFT / ITL p50 (right, log scale) against the load level as a PNG.

    One line per label and metric; the parent directory is created. Returns the path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import StrMethodFormatter

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_tput, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in dict.fromkeys(r.label for r in results):
        rows = sorted((r for r in results if r.label == label), key=lambda r: r.level)
        x = [r.level for r in rows]
        ax_tput.plot(x, [r.output_throughput for r in rows], marker="o", label=label)
        ax_lat.plot(x, [r.ttft_ms["p50"] for r in rows], marker="o", label=f"{label} TTFT p50")
        ax_lat.plot(x, [r.itl_ms["p50"] for r in rows], marker="s", linestyle="--", label=f"{label} ITL p50")
    xlabel = MODE_AXIS.get(results[0].mode, "level") if results else "level"
    ax_tput.set(xlabel=xlabel, ylabel="output tokens/s", title="Output throughput")
    ax_lat.set(xlabel=xlabel, ylabel="ms", title="Latency (p50)", yscale="log")
    plain = StrMethodFormatter("{x:g}")
    ax_lat.yaxis.set_major_formatter(plain)
    ax_lat.yaxis.set_minor_formatter(plain)
    for ax in (ax_tput, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r.level for r in results}))
        ax.xaxis.set_major_formatter(plain)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
