"""Serving benchmark for any OpenAI-compatible server (pdserve, llama.cpp, vLLM, SGLang): ``make bench``.

Streams ``/v1/completions`` through the official ``openai`` client, sweeps fixed concurrencies
(``--concurrency 1,16,64``) or Poisson request rates (``--request-rate 2,8``), and reports per level
the output tok/s, req/s and TTFT / ITL / E2E p50 / p90 / p99 measured from the streamed chunks. It
prints a table, writes a PNG plot, and ends stdout with one JSON line holding every result.

Targets: ``--base-url URL`` (a running server), ``--launch "FLAGS"`` (start ``pdserve launch FLAGS``
on free ports), or ``--compare "A=FLAGS" "B=FLAGS"`` (each pdserve configuration in turn, in one
run, with ratios to the first; ``"A@CHECKOUT=FLAGS"`` runs another checkout of pdserve, with its own
``.venv``, for before / after comparisons). With none of them, pdserve is launched ``--colocated``.
``--repeat N`` runs the launched configurations N rounds in turn (labels ``A#1``, ``B#1``, ``A#2``,
...) and adds a table of medians over the rounds, with the median ratio of neighbours (on a noisy
machine the one comparison to trust).

``--workload tenants`` gives each of ``--tenants`` tenants its own ``--prefix-tokens`` system prompt
and sends their requests in random order; the table's ``cached`` column is the share of prompt
tokens served from the workers' prefix caches (issue 40's routing workload: several decode workers
whose pools hold only some of the prefixes, one or two gateways, one router policy per label).

``--lora-mix 0,1,4,16`` serves random rank-``--lora-rank`` LoRA adapters (written for the model and
added to every launched configuration's flags) and runs every level once per mix, its requests
spread round-robin over that many adapters (0: the base model), labelled ``<label> lora<N>``.

``--workload priority`` measures a high-priority request's TTFT under a saturating low-priority load
against an idle server's (``serving_lib/priority.py``; launch with ``--schedule-policy priority``).

Example: ``make bench ARGS='--workload shared-prefix --compare "cache=--colocated"
"nocache=--colocated --disable-radix-cache" --concurrency 16'``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import logging
import os
import shlex
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import openai

from benchmarks.serving_lib.adapters import write_adapters
from benchmarks.serving_lib.client import CompletionTarget, stream_completion
from benchmarks.serving_lib.launch import DEFAULT_FLAGS, LaunchSpec, launched, parse_compare
from benchmarks.serving_lib.load import LoadMode, run_level
from benchmarks.serving_lib.priority import PriorityLoad, bench_priority, priority_table
from benchmarks.serving_lib.report import json_line, plot, round_label, rounds, rounds_table, table
from benchmarks.serving_lib.spec_metrics import spec_counters, spec_summary
from benchmarks.serving_lib.stats import LevelResult, RequestRecord, summarize
from benchmarks.serving_lib.tokens import TokenCounter
from benchmarks.serving_lib.workload import PromptSource, WorkloadKind
from pdserve.model_source import resolve_model

log = logging.getLogger("benchmarks.serving")


@dataclass(slots=True)
class BenchConfig:
    """Benchmark settings shared by every server of one run (see ``--help`` for each field).

    ``num_requests=None`` means ``max(8, 2 * concurrency)`` per concurrency level and 32 per
    request-rate level.
    """

    workload: WorkloadKind = "random"
    prompt_tokens: int = 128
    prefix_tokens: int = 1000
    tenants: int = 16
    output_tokens: int = 64
    mode: LoadMode = "concurrency"
    levels: list[float] = field(default_factory=lambda: [1, 16, 64])
    num_requests: int | None = None
    warmup: int = 2
    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int = 0
    model: str | None = None
    request_timeout_s: float = 600.0
    priority: PriorityLoad | None = None  # the priority workload (random prompts), instead of levels
    lora_mix: list[int] = field(default_factory=list)  # adapters per run of the levels (0: the base)
    lora_rank: int = 16

    def requests_at(self, level: float) -> int:
        if self.num_requests is not None:
            return self.num_requests
        return max(8, 2 * int(level)) if self.mode == "concurrency" else 32


def openai_base_url(url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` → the OpenAI base URL ending in ``/v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


async def bench_server(
    base_url: str, label: str, cfg: BenchConfig, api_key: str | None = None
) -> tuple[list[LevelResult], dict]:
    """Warm up, then run every level of ``cfg`` against one server.

    Returns the per-level results and a run description (label, base_url, model, how prompt
    tokens were counted). Raises openai.OpenAIError if the model list cannot be read.
    """
    base_url = openai_base_url(base_url)
    key, timeout = api_key or "none", cfg.request_timeout_s
    async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=timeout) as client:
        model = cfg.model or (await client.models.list()).data[0].id
        async with await TokenCounter.connect(base_url.removesuffix("/v1"), model, api_key) as counter:
            tokens_per_word = await counter.tokens_per_word(cfg.seed)
            kind = "random" if cfg.priority else cfg.workload
            lengths = cfg.prompt_tokens, cfg.prefix_tokens
            source = PromptSource(kind, *lengths, cfg.seed, tokens_per_word, cfg.tenants)
            target = CompletionTarget(client, model, cfg.output_tokens, cfg.temperature, cfg.ignore_eos)
            root = base_url.removesuffix("/v1")
            run = {"label": label, "base_url": base_url, "model": model, "token_counter": counter.source}
            if cfg.priority:

                async def prompts(count: int) -> list[tuple[str, int]]:
                    texts = source.take(count)
                    return list(zip(texts, await counter.count(texts), strict=True))

                run["priority"] = await bench_priority(target, prompts, cfg.priority)
                results = []
            else:
                results = []
                read_spec = lambda: spec_counters(root, api_key)
                for n in cfg.lora_mix or [None]:
                    models = [model] if not n else [f"a{i}" for i in range(n)]
                    name = label if n is None else f"{label} lora{n}"
                    results += await sweep(target, counter, source, cfg, name, read_spec, models)
    return results, run | {"tokens_per_word": round(tokens_per_word, 4)}


async def sweep(
    target: CompletionTarget,
    counter: TokenCounter,
    source: PromptSource,
    cfg: BenchConfig,
    label: str,
    read_spec: Callable[[], Awaitable[dict[str, float]]] | None = None,
    models: list[str] | None = None,
) -> list[LevelResult]:
    """``cfg.warmup`` uncounted requests, then each level of ``cfg`` in turn with fresh prompts;
    ``read_spec`` reads the server's speculative decoding counters around each level; ``models``:
    the model names the requests take in turn (default: the target's)."""
    names = itertools.cycle(models or [target.model])

    async def send(item: tuple[str, int]) -> RequestRecord:
        return await stream_completion(dataclasses.replace(target, model=next(names)), *item)

    async def prompts(count: int) -> list[tuple[str, int]]:
        texts = source.take(count)
        return list(zip(texts, await counter.count(texts), strict=True))

    if cfg.warmup:
        await run_level(send, await prompts(cfg.warmup), "concurrency", cfg.warmup, desc=f"{label} warmup")
    results = []
    for i, level in enumerate(cfg.levels):
        desc = f"{label} {cfg.mode}={level:g}"
        items = await prompts(cfg.requests_at(level))
        before = await read_spec() if read_spec else {}
        records = await run_level(send, items, cfg.mode, level, seed=cfg.seed + i, desc=desc)
        results.append(summarize(label, cfg.mode, level, records))
        if read_spec:
            results[-1].spec = spec_summary(before, await read_spec())
        log.info("%s: %.1f out tok/s, %d errors", desc, results[-1].output_throughput, results[-1].errors)
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n\n")[0])
    target = p.add_mutually_exclusive_group()
    target.add_argument("--base-url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    target.add_argument("--launch", metavar="FLAGS", help='start "pdserve launch FLAGS" for the run')
    target.add_argument("--compare", nargs="+", metavar="LABEL=FLAGS", help="several pdserve configs in turn")
    p.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer key (default $OPENAI_API_KEY)"
    )
    p.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    p.add_argument(
        "--workload",
        choices=["random", "shared-prefix", "tenants", "grounded", "priority"],
        default="random",
        help="grounded: answers that copy spans of the prompt (where speculative drafts stand); "
        "priority: high-priority probes' TTFT under a low-priority load (its first --concurrency "
        "streams) against idle",
    )
    p.add_argument("--probes", type=int, default=8, help="priority workload: probes per phase")
    p.add_argument(
        "--probe-interval", type=float, default=1.0, help="priority workload: seconds between probes"
    )
    p.add_argument("--probe-priority", type=int, default=-10, help="priority workload: the probes' priority")
    p.add_argument("--load-priority", type=int, default=10, help="priority workload: the load's priority")
    p.add_argument("--prompt-tokens", type=int, default=128, help="random workload: prompt length in tokens")
    p.add_argument(
        "--prefix-tokens", type=int, default=1000, help="shared-prefix / tenants workloads: preamble tokens"
    )
    p.add_argument("--tenants", type=int, default=16, help="tenants workload: tenants (one preamble each)")
    p.add_argument(
        "--output-tokens", type=int, help="tokens per request (default 64; shared-prefix and tenants 32)"
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default="1,16,64", help="comma-separated concurrency levels")
    load.add_argument("--request-rate", help="comma-separated Poisson request rates (req/s)")
    p.add_argument(
        "--num-requests", type=int, help="requests per level (default max(8, 2*c); shared-prefix 64)"
    )
    p.add_argument(
        "--lora-mix", help="comma-separated adapter counts, e.g. 0,1,4,16: the levels run once per count"
    )
    p.add_argument("--lora-rank", type=int, default=16, help="--lora-mix: the adapters' rank")
    p.add_argument("--warmup", type=int, default=2, help="uncounted requests before the first level")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--plot", default="bench-results/serving.png", help="PNG path ('' for none)")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="launched configurations: rounds, with medians",
    )
    args = p.parse_args(argv)
    if args.repeat < 1 or (args.repeat > 1 and args.base_url):
        p.error("--repeat must be >= 1, and a --base-url server runs once")
    return args


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    shared = args.workload in ("shared-prefix", "tenants")
    mode: LoadMode = "request_rate" if args.request_rate else "concurrency"
    levels = [float(v) for v in (args.request_rate or args.concurrency).split(",") if v.strip()]
    if mode == "concurrency":
        levels = [int(v) for v in levels]
    priority = None
    if args.workload == "priority":
        priority = PriorityLoad(
            int(levels[0]), args.probes, args.probe_interval, args.probe_priority, args.load_priority
        )
    return BenchConfig(
        workload=args.workload,
        prompt_tokens=args.prompt_tokens,
        prefix_tokens=args.prefix_tokens,
        tenants=args.tenants,
        output_tokens=args.output_tokens or (32 if shared else 64),
        mode=mode,
        levels=levels,
        num_requests=args.num_requests or (64 if shared else None),
        warmup=args.warmup,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        model=args.model,
        request_timeout_s=args.request_timeout,
        priority=priority,
        lora_mix=[int(n) for n in args.lora_mix.split(",")] if args.lora_mix else [],
        lora_rank=args.lora_rank,
    )


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark from command-line ``argv``; print the table and the JSON line, return that JSON."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("benchmarks").setLevel(logging.INFO)
    args = parse_args(argv)
    cfg = config_from_args(args)
    results: list[LevelResult] = []
    runs: list[dict] = []
    if args.base_url:
        level_results, run = asyncio.run(bench_server(args.base_url, "server", cfg, args.api_key))
        results += level_results
        runs.append(run | {"launch": None})
    else:
        specs = [parse_compare(s) for s in args.compare] if args.compare else []
        specs = specs or [LaunchSpec("pdserve", args.launch if args.launch is not None else DEFAULT_FLAGS)]
        specs = [
            dataclasses.replace(s, label=round_label(s.label, k, args.repeat))
            for k in range(1, args.repeat + 1)
            for s in specs
        ]
        with tempfile.TemporaryDirectory() as scratch:
            for spec in specs:
                extra = lora_flags(cfg, spec, Path(scratch))
                spec = dataclasses.replace(spec, flags=f"{spec.flags} {extra}".strip())
                with launched(spec) as stack:
                    level_results, run = asyncio.run(
                        bench_server(stack.base_url, spec.label, cfg, args.api_key)
                    )
                results += level_results
                runs.append(run | {"launch": spec.flags})
    return report(results, runs, cfg, args.plot)


def lora_flags(cfg: BenchConfig, spec: LaunchSpec, scratch: Path) -> str:
    """The ``pdserve launch`` flags serving ``cfg.lora_mix``'s adapters, written under ``scratch``
    for the model ``spec`` launches (its ``--model``, else the default)."""
    count = max(cfg.lora_mix, default=0)
    if not count:
        return ""
    flags = shlex.split(spec.flags)
    model = flags[flags.index("--model") + 1] if "--model" in flags[:-1] else None
    directory = scratch / "".join(c if c.isalnum() else "_" for c in spec.label)
    adapters = write_adapters(directory, resolve_model(model), count, cfg.lora_rank)
    modules = " ".join(f"{name}={path}" for name, path in adapters)
    return f"--lora-modules {modules} --max-loras {count} --max-lora-rank {cfg.lora_rank}"


def report(results: list[LevelResult], runs: list[dict], cfg: BenchConfig, plot_path: str | None) -> dict:
    """Write the plot (unless ``plot_path`` is empty), print the table, then the JSON line last on stdout.

    Returns the JSON document as a dict.
    """
    if cfg.priority:
        print("\n".join(priority_table(run["label"], cfg.priority, run["priority"]) for run in runs))
    else:
        if plot_path:
            log.info("plot written to %s", plot(results, plot_path))
        print(table(results))
        if summary := rounds(results):
            print(f"\nmedians over the rounds:\n{rounds_table(summary)}")
    line = json_line(results, runs, dataclasses.asdict(cfg))
    print(line, flush=True)
    return json.loads(line)


if __name__ == "__main__":
    main()
