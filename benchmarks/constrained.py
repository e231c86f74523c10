"""Constrained decoding: its throughput overhead through the stack, and grammar compile times.

``make bench-constrained`` (``python -m benchmarks.constrained``):

1. Compile time (in this process, the model's tokenizer, one compile thread as a scheduler runs
   it): the vocabulary analysis a scheduler does once (``TokenizerInfo``), then a 50-property JSON
   Schema compiled cold (``--compiles`` distinct variants, each a cache miss) and cached (the same
   spec again: the scheduler's cache hands back the compiled grammar).
2. Throughput (``pdserve launch FLAGS``, colocated by default): the same chat prompts, ``--concurrency``
   in flight, once held to a JSON Schema (``response_format``) and once free. The free side asks
   each request for exactly the number of tokens its constrained twin produced (``max_tokens``
   with ``ignore_eos``), so both sides generate the same tokens per request and differ only in
   the grammar work. ``--rounds`` alternates the order (constrained first, then free first, ...)
   so the drift of a shared machine hits both alike. Beside wall-clock tokens per second, each
   side's CPU seconds of the stack's processes are measured (psutil): on a loaded machine the
   CPU time per output token is the steadier measure of the grammar's cost.

Prints a table per round, then one JSON line with the compile times and the ratios constrained /
free over all rounds of output tok/s and of output tokens per stack CPU second (the aim of
issue 22: overhead <= 10%, ratio >= 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import openai
from tabulate import tabulate

from benchmarks.serving_lib.launch import LaunchSpec, launched
from benchmarks.serving_lib.load import run_level
from benchmarks.serving_lib.procs import cpu_seconds, pdserve_processes
from benchmarks.serving_lib.stats import RequestRecord, summarize
from pdserve.constrained import GrammarSpec
from pdserve.constrained.backend import GrammarBackend
from pdserve.layers.native import cpu_description

CITIES = ["Paris", "Rome", "Oslo", "Lima", "Kyoto", "Cairo", "Quito", "Perth"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": CITIES},
        "hobbies": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "minItems": 3,
            "maxItems": 3,
        },
        "married": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "married"],
    "additionalProperties": False,
}


def schema_of_50(variant: int) -> str:
    """A 50-property object of mixed types (``variant`` renames it, so each variant misses the cache)."""
    kinds = [
        {"type": "string", "maxLength": 32},
        {"type": "integer", "minimum": 0, "maximum": 1000},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "array", "items": {"type": "string"}},
    ]
    properties = {f"field_{variant}_{i}": kinds[i % len(kinds)] for i in range(50)}
    return json.dumps({"type": "object", "properties": properties, "required": list(properties)})


def compile_times(compiles: int) -> dict:
    """Seconds: the tokenizer analysis, then cold (median of ``compiles`` variants) and cached compiles."""
    from transformers import AutoTokenizer

    from pdserve.model_source import resolve_model

    path = resolve_model()
    backend = GrammarBackend(lambda: AutoTokenizer.from_pretrained(path), 49152, [2])
    start = time.perf_counter()
    backend.compile(GrammarSpec("regex", "warm-up"))[0].result()
    setup = time.perf_counter() - start
    cold, cached = [], []
    for variant in range(compiles):
        spec = GrammarSpec("json_schema", schema_of_50(variant))
        start = time.perf_counter()
        backend.compile(spec)[0].result()
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        future, hit = backend.compile(spec)
        future.result()
        cached.append(time.perf_counter() - start)
        assert hit
    backend.close()
    return {
        "tokenizer_analysis_s": round(setup, 3),
        "cold_ms": round(statistics.median(cold) * 1e3, 2),
        "cached_ms": round(statistics.median(cached) * 1e3, 4),
    }


def prompts(n: int) -> list[list[dict]]:
    return [
        [
            {
                "role": "user",
                "content": f"Invent person number {i}, who lives in {CITIES[i % len(CITIES)]}, as JSON.",
            }
        ]
        for i in range(n)
    ]


async def chat(client: openai.AsyncOpenAI, model: str, messages: list[dict], **kwargs) -> RequestRecord:
    """One streamed chat completion, timed on the client; output tokens from the usage chunk."""
    record = RequestRecord(prompt_tokens=0, start=time.perf_counter())
    last = record.start
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].delta.content:
                if record.ttft is None:
                    record.ttft = now - record.start
                else:
                    record.itl.append(now - last)
                last = now
            if chunk.usage is not None:
                record.output_tokens = chunk.usage.completion_tokens
                record.prompt_tokens = chunk.usage.prompt_tokens
    except openai.APIError as e:
        record.error = str(e)
    record.end = time.perf_counter()
    return record


async def throughput(stack, model: str, n: int, concurrency: int, rounds: int) -> list[dict]:
    """Per round and side: ``summarize``'s numbers plus ``cpu_s``, the CPU seconds the stack's
    processes used while that side ran."""
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0, timeout=600)
    processes = pdserve_processes(stack.proc.pid)
    items = list(enumerate(prompts(n)))
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    lengths: dict[int, int] = {}

    async def constrained(item) -> RequestRecord:
        i, messages = item
        record = await chat(
            client, model, messages, temperature=0, max_tokens=256, response_format=schema_format
        )
        lengths[i] = record.output_tokens
        return record

    async def free(item) -> RequestRecord:
        i, messages = item
        return await chat(
            client, model, messages, temperature=0, max_tokens=lengths[i], extra_body={"ignore_eos": True}
        )

    await run_level(constrained, items[:concurrency], "concurrency", concurrency, desc="warm-up")
    results = []
    for r in range(rounds):
        order = [("constrained", constrained), ("free", free)]
        if r % 2:
            order.reverse()
        for label, send in order:
            with cpu_seconds(processes) as cpu:
                records = await run_level(send, items, "concurrency", concurrency, desc=f"{label} round {r}")
            summary = summarize(label, "concurrency", concurrency, records).to_dict()
            results.append({"round": r, **summary, "cpu_s": round(sum(cpu.values()), 2)})
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.constrained", description=__doc__)
    p.add_argument("--flags", default="--colocated --max-total-tokens 65536", help="pdserve launch flags")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--compiles", type=int, default=5, help="distinct 50-property schemas compiled cold")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="served model name")
    args = p.parse_args(argv)

    compile_result = compile_times(args.compiles)
    with launched(LaunchSpec("constrained", args.flags)) as stack:
        results = asyncio.run(throughput(stack, args.model, args.num_requests, args.concurrency, args.rounds))
    rows = [
        [r["round"], r["label"], r["completed"], r["errors"], r["mean_output_tokens"], r["output_throughput"],
         r["cpu_s"], r["ttft_ms"]["p50"], r["itl_ms"]["p50"], r["e2e_ms"]["p50"]]
        for r in results
    ]  # fmt: skip
    headers = ["round", "side", "ok", "errors", "out tokens", "out tok/s", "stack CPU s", "TTFT p50",
               "ITL p50", "E2E p50"]  # fmt: skip
    cpu = cpu_description()
    print(f"CPU: {cpu}")
    print(tabulate(rows, headers=headers))
    ratio, cpu_ratio = side_ratio(results, "output_throughput"), side_ratio(results, "tokens_per_cpu_s")
    print(
        f"\n50-property schema: tokenizer analysis {compile_result['tokenizer_analysis_s']} s (once per "
        f"scheduler), compile cold {compile_result['cold_ms']} ms, cached {compile_result['cached_ms']} ms; "
        f"constrained / free at concurrency {args.concurrency}: output tok/s {ratio}, "
        f"output tokens per stack CPU second {cpu_ratio}"
    )
    summary = {"cpu": cpu, "compile": compile_result, "ratio": ratio, "cpu_ratio": cpu_ratio}
    print(json.dumps({**summary, "target_ratio": 0.9, "results": results}))


def side_ratio(results: list[dict], key: str) -> float | None:
    """Constrained / free over all rounds: of the summed output tok/s (``output_throughput``), or of
    output tokens per CPU second of the stack (``tokens_per_cpu_s``: all tokens over all CPU seconds)."""

    def side(label: str) -> float:
        rows = [r for r in results if r["label"] == label]
        if key == "output_throughput":
            return sum(r[key] for r in rows)
        cpu = sum(r["cpu_s"] for r in rows)
        return sum(r["completed"] * r["mean_output_tokens"] for r in rows) / cpu if cpu else 0.0

    free = side("free")
    return round(side("constrained") / free, 3) if free else None


if __name__ == "__main__":
    main()
