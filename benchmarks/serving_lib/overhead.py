"""Results of the gateway-overhead benchmark: each side's runs, the scheduler's own latencies, the
per-level http / in-process ratio with CPU per token, and the printed table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from tabulate import tabulate

from benchmarks.serving_lib.stats import LevelResult

HTTP, IN_PROCESS = "http", "in-process"
TARGET_RATIO = 0.9  # issue 8: HTTP reaches at least 90% of the in-process output tok/s
# latency histograms the scheduler core keeps itself, the same on both sides (seconds)
SCHEDULER_LATENCIES = {
    "itl": "pdserve:inter_token_latency_seconds",
    "ttft": "pdserve:time_to_first_token_seconds",
}


@dataclass(slots=True)
class SideRun:
    """One level of one side in one round: its summary, the CPU seconds of every process meanwhile, and
    the mean TTFT / ITL (ms) the scheduler itself measured.

    ``cpu_s`` names the stack's services by role and this process ``bench`` (the HTTP client on the
    http side; the scheduler and its driver on the in-process side). ``scheduler_ms`` has keys
    ``ttft`` and ``itl``: the scheduler's ITL is the time between two of a request's steps, so beside the
    client's ITL it splits a gap into the scheduler's step and what the transport adds.
    """

    round: int
    result: LevelResult
    cpu_s: dict[str, float]
    scheduler_ms: dict[str, float | None]


def latency_totals(metrics_text: str, role: str | None = None) -> dict[str, float]:
    """``{"itl_sum", "itl_count", "ttft_sum", "ttft_count"}`` of :data:`SCHEDULER_LATENCIES` in a
    Prometheus text, summed over the samples labelled ``role`` (every sample when None).
    """
    wanted = {
        f"{series}_{part}": f"{key}_{part}"
        for key, series in SCHEDULER_LATENCIES.items()
        for part in ("sum", "count")
    }
    totals = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in wanted and (role is None or sample.labels.get("role") == role):
                totals[wanted[sample.name]] += sample.value
    return totals


def mean_latency_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean TTFT and ITL in ms (``{"ttft", "itl"}``; None without samples) between two
    :func:`latency_totals`.
    """
    means = {}
    for key in SCHEDULER_LATENCIES:
        count = after[f"{key}_count"] - before[f"{key}_count"]
        means[key] = round(1000 * (after[f"{key}_sum"] - before[f"{key}_sum"]) / count, 2) if count else None
    return means


def _tokens_per_s(runs: Sequence[SideRun]) -> float:
    seconds = sum(r.result.duration_s for r in runs)
    return _output_tokens(runs) / seconds if seconds else 0.0


def _output_tokens(runs: Sequence[SideRun]) -> float:
    return sum(r.result.mean_output_tokens * r.result.completed for r in runs)


def _cpu_ms_per_token(runs: Sequence[SideRun], bench: bool) -> float | None:
    """CPU ms per output token of this process (``bench``) or of the stack's services (not ``bench``)."""
    cpu = sum(s for r in runs for name, s in r.cpu_s.items() if (name == "bench") == bench)
    tokens = _output_tokens(runs)
    return round(1000 * cpu / tokens, 3) if tokens else None


def summarize_overhead(runs: Sequence[SideRun]) -> list[dict]:
    """Per level: each side's output tok/s over every round (tokens / seconds, summed), their ratio
    http / in-process, the ratio of each round on its own, and the CPU ms per output token of the
    in-process scheduler, of the stack's services and of the HTTP client.
    """
    rows = []
    for level in dict.fromkeys(r.result.level for r in runs):
        at = [r for r in runs if r.result.level == level]
        http = [r for r in at if r.result.label == HTTP]
        local = {r.round: r for r in at if r.result.label == IN_PROCESS}
        http_tps, local_tps = _tokens_per_s(http), _tokens_per_s(list(local.values()))
        ratio = round(http_tps / local_tps, 3) if local_tps else None
        rows.append(
            {
                "level": level,
                "http_tok_s": round(http_tps, 2),
                "in_process_tok_s": round(local_tps, 2),
                "ratio": ratio,
                "round_ratios": [
                    round(h.result.output_throughput / local[h.round].result.output_throughput, 3)
                    for h in http
                    if h.round in local and local[h.round].result.output_throughput
                ],
                "meets_target": ratio is not None and ratio >= TARGET_RATIO,
                "cpu_ms_per_token": {
                    "in_process": _cpu_ms_per_token(list(local.values()), bench=True),
                    "http_services": _cpu_ms_per_token(http, bench=False),
                    "http_client": _cpu_ms_per_token(http, bench=True),
                },
            }
        )
    return rows


def overhead_table(runs: Sequence[SideRun], summary: Sequence[dict]) -> str:
    """Per level and round, each side's throughput, client latencies (p50/p90, ms), the scheduler's own
    mean TTFT / ITL (ms), CPU cores kept busy (CPU seconds of every process / wall seconds), the
    serving side's CPU ms per output token (in-process: this process; http: the stack's services) and
    the CPU seconds of every process; then per level the totals over every round.
    """
    procs = sorted({name for r in runs for name in r.cpu_s}, key=lambda p: (p != "bench", p != "decode", p))
    local = {
        (r.result.level, r.round): r.result.output_throughput for r in runs if r.result.label == IN_PROCESS
    }
    headers = ["c", "round", "side", "ok", "err", "out tok/s", "http/in-proc", "TTFT p50", "ITL p50"]
    headers += ["ITL p90", "E2E p50", "sched TTFT", "sched ITL", "cores busy", "cpu ms/tok"]
    headers += [f"cpu s {p}" for p in procs]
    rows = []
    for r in sorted(runs, key=lambda r: (r.result.level, r.round, r.result.label != IN_PROCESS)):
        res = r.result
        base = local.get((res.level, r.round)) if res.label == HTTP else None
        rows.append(
            [res.level, r.round, res.label, res.completed, res.errors, res.output_throughput]
            + [res.output_throughput / base if base else None, res.ttft_ms["p50"], res.itl_ms["p50"]]
            + [res.itl_ms["p90"], res.e2e_ms["p50"], r.scheduler_ms["ttft"], r.scheduler_ms["itl"]]
            + [sum(r.cpu_s.values()) / res.duration_s, _cpu_ms_per_token([r], bench=res.label == IN_PROCESS)]
            + [r.cpu_s.get(p) for p in procs]
        )
    for s in summary:
        cpu = s["cpu_ms_per_token"]
        for side, tps, ratio, cpu_ms in (
            (HTTP, s["http_tok_s"], s["ratio"], cpu["http_services"]),
            (IN_PROCESS, s["in_process_tok_s"], None, cpu["in_process"]),
        ):
            rows.append([s["level"], "all", side, None, None, tps, ratio, *[None] * 7, cpu_ms])
    floatfmt = ["g", "", "", "", "", ".1f", ".3f", ".0f", ".1f", ".1f", ".0f", ".0f", ".1f", ".2f", ".2f"]
    floatfmt += [".1f"] * len(procs)
    return tabulate(rows, headers=headers, floatfmt=floatfmt, missingval="-")
