"""Gateway overhead: the colocated stack through HTTP beside its own scheduler driven in-process.

``make bench-gateway`` (``python -m benchmarks.gateway_overhead``) launches ``pdserve launch FLAGS``
(colocated) and, in this process, builds the same scheduler core from the same FLAGS
(:mod:`benchmarks.serving_lib.in_process`). Both run the same prompts of the random workload
(same generator, fresh prompts for every level and round, token ids from the model's own tokenizer
for the in-process side), the same ``max_tokens`` with ``ignore_eos``, at fixed concurrencies
(``--concurrency 16,64``: C requests in flight, a new one joins when one finishes), timed by the
same statistics code. ``--rounds`` repeats every level with the order of the two sides swapped
each round, so the drift of a shared machine hits both alike. Both sides must load the same C
kernels (checked after the warm-up, reported in the JSON).

Threads: both forwards use N intra-op threads (``--threads``, default torch's own choice, one per
core): the stack's processes get ``OMP_NUM_THREADS=N``, this process ``torch.set_num_threads(N)``.
On the HTTP side the gateway, tokenizer, detokenizer and the HTTP client (this process) share the
cores with that forward; ``--threads`` below the core count leaves them cores of their own.

Prints a table (per level and round: output tok/s, the http / in-process ratio, client TTFT / ITL /
E2E, the scheduler's own mean TTFT / ITL, cores kept busy, CPU ms per output token and the CPU
seconds of every process), then one JSON line with every result and, per level, the throughput
ratio over all rounds against the 0.9 target of issue 8.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shlex
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import httpx
import openai
import psutil
import torch

from benchmarks.serving_lib.client import CompletionTarget, stream_completion
from benchmarks.serving_lib.in_process import InProcessServer
from benchmarks.serving_lib.launch import LaunchSpec, launched
from benchmarks.serving_lib.load import Send, run_level
from benchmarks.serving_lib.overhead import (
    HTTP,
    IN_PROCESS,
    TARGET_RATIO,
    SideRun,
    latency_totals,
    mean_latency_ms,
    overhead_table,
    summarize_overhead,
)
from benchmarks.serving_lib.procs import (
    cpu_seconds,
    loaded_kernels,
    pdserve_processes,
    rerun_with_scheduler_env,
)
from benchmarks.serving_lib.stats import RequestRecord, summarize
from benchmarks.serving_lib.tokens import TokenCounter
from benchmarks.serving_lib.workload import PromptSource
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.tokenization import Tokenizer
from tests.stack import Stack

log = logging.getLogger("benchmarks.gateway_overhead")

DEFAULT_FLAGS = "--colocated --dtype bfloat16 --max-total-tokens 32768"
Item = tuple[str, list[int]]  # prompt text, its token ids


@dataclass(slots=True)
class OverheadConfig:
    """Workload and repetition settings (see ``--help``); ``num_requests=None`` means ``max(8, 2 * C)``."""

    prompt_tokens: int = 128
    output_tokens: int = 64
    levels: tuple[int, ...] = (16, 64)
    num_requests: int | None = None
    rounds: int = 2
    warmup: int = 4
    seed: int = 0
    request_timeout_s: float = 600.0

    def requests_at(self, level: int) -> int:
        return self.num_requests or max(8, 2 * level)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OverheadConfig:
        """From the workload options both overhead benchmarks share (``--concurrency`` comma-separated)."""
        return cls(
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            levels=tuple(int(v) for v in args.concurrency.split(",") if v.strip()),
            num_requests=args.num_requests,
            rounds=args.rounds,
            warmup=args.warmup,
            seed=getattr(args, "seed", 0),
        )


class OverheadBench:
    """Runs the comparison against one launched stack and one in-process server (same flags).

    After :meth:`run`, ``kernels`` holds the C kernels each side's scheduler loaded (they must match).
    ``around_side(side, level, round)``, when given, returns a context manager that each counted run
    of a side runs inside (e.g. a profiler; round -1 is the warm-up, which it does not wrap).
    """

    def __init__(
        self,
        stack: Stack,
        server: InProcessServer,
        tokenizer: Tokenizer,
        cfg: OverheadConfig,
        around_side: Callable[[str, int, int], AbstractContextManager] | None = None,
    ):
        self.stack, self.server, self.tokenizer, self.cfg = stack, server, tokenizer, cfg
        self.around_side = around_side
        self.processes = pdserve_processes(stack.proc.pid) | {"bench": psutil.Process()}
        self.params = SamplingParams(temperature=0.0, max_new_tokens=cfg.output_tokens, ignore_eos=True)
        self.kernels: dict[str, list[str]] = {}

    async def run(self) -> list[SideRun]:
        """Warm both sides up, then every round and level, alternating which side goes first."""
        cfg = self.cfg
        url, timeout = f"{self.stack.base_url}/v1", cfg.request_timeout_s
        async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=timeout) as client:
            model = (await client.models.list()).data[0].id
            async with await TokenCounter.connect(self.stack.base_url, model) as counter:
                tokens_per_word = await counter.tokens_per_word(cfg.seed)
            # the random workload has no preamble: prefix_tokens=1 is unused
            source = PromptSource("random", cfg.prompt_tokens, 1, cfg.seed, tokens_per_word)
            target = CompletionTarget(client, model, cfg.output_tokens)
            sides = {
                HTTP: lambda item: stream_completion(target, item[0], len(item[1])),
                IN_PROCESS: self._in_process,
            }
            warm = self._prompts(source, cfg.warmup)
            for side, send in sides.items():
                await self._side(side, send, warm, cfg.warmup, -1)
            self.kernels = {
                HTTP: loaded_kernels(self.processes["decode"]),
                IN_PROCESS: loaded_kernels(self.processes["bench"]),
            }
            if self.kernels[HTTP] != self.kernels[IN_PROCESS]:
                log.warning("the two sides loaded different kernels: %s", self.kernels)
            runs = []
            for rnd in range(cfg.rounds):
                for level in cfg.levels:
                    items = self._prompts(source, cfg.requests_at(level))
                    for side in (HTTP, IN_PROCESS) if rnd % 2 == 0 else (IN_PROCESS, HTTP):
                        runs.append(await self._side(side, sides[side], items, level, rnd))
                        tps = runs[-1].result.output_throughput
                        log.info("round %d c=%d %s: %.1f out tok/s", rnd, level, side, tps)
        return runs

    def _prompts(self, source: PromptSource, count: int) -> list[Item]:
        texts = source.take(count)
        return list(zip(texts, self.tokenizer.encode_batch(texts), strict=True))

    async def _side(self, side: str, send: Send[Item], items: list[Item], level: int, rnd: int) -> SideRun:
        desc = f"round {rnd} {side} c={level}" if rnd >= 0 else f"{side} warmup"
        before = await self._latency_totals(side)
        around = self.around_side(side, level, rnd) if self.around_side and rnd >= 0 else nullcontext()
        with around, cpu_seconds(self.processes) as cpu:
            if side == HTTP:
                records = await run_level(send, items, "concurrency", level, desc=desc)
            else:
                async with self.server:
                    records = await run_level(send, items, "concurrency", level, desc=desc)
        await self._check_idle(side)
        scheduler_ms = mean_latency_ms(before, await self._latency_totals(side))
        return SideRun(rnd, summarize(side, "concurrency", level, records), cpu, scheduler_ms)

    async def _latency_totals(self, side: str) -> dict[str, float]:
        if side == IN_PROCESS:
            return latency_totals(self.server.scheduler.metrics.text())
        async with httpx.AsyncClient(base_url=self.stack.base_url, timeout=30) as http:
            return latency_totals((await http.get("/metrics")).text, role="mixed")

    async def _in_process(self, item: Item) -> RequestRecord:
        return (await self.server.generate(item[1], self.params)).record

    async def _check_idle(self, side: str) -> None:
        """Every page back after a run (raises AssertionError otherwise)."""
        if side == HTTP:
            await asyncio.to_thread(self.stack.check_kv_conservation)
            return
        sched = self.server.scheduler
        assert not sched.has_work() and sched.ledger.used_pages() == 0, "in-process scheduler not idle"
        sched.check_invariants()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gateway_overhead", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--flags", default=DEFAULT_FLAGS, help="pdserve launch flags of both sides (colocated)")
    p.add_argument("--concurrency", default="16,64", help="comma-separated concurrency levels")
    p.add_argument("--num-requests", type=int, help="requests per level and side (default max(8, 2*c))")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="repeats of every level, sides alternating")
    p.add_argument("--warmup", type=int, default=4, help="uncounted requests per side first")
    p.add_argument("--threads", type=int, help="torch intra-op threads of both sides (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison from command-line ``argv``; print the table and the JSON line, return that JSON."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("benchmarks").setLevel(logging.INFO)
    argv = sys.argv[1:] if argv is None else argv
    rerun_with_scheduler_env("benchmarks.gateway_overhead", argv)
    args = parse_args(argv)
    cfg = OverheadConfig.from_args(args)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by every process of the stack
    with launched(LaunchSpec("gateway-overhead", args.flags)) as stack:
        # built once the stack is up (both load the same code from disk), on a thread that ends
        # before the run (see InProcessServer.from_launch_flags)
        with ThreadPoolExecutor(1) as pool:
            server = pool.submit(InProcessServer.from_launch_flags, shlex.split(args.flags)).result()
        tokenizer = Tokenizer.load(str(server.model_dir))
        bench = OverheadBench(stack, server, tokenizer, cfg)
        runs = asyncio.run(bench.run())
    summary = summarize_overhead(runs)
    print(overhead_table(runs, summary))
    doc = {
        "config": {"flags": args.flags, "threads": threads, **dataclasses.asdict(cfg)},
        "runs": [
            {"round": r.round, "cpu_s": r.cpu_s, "scheduler_ms": r.scheduler_ms, **r.result.to_dict()}
            for r in runs
        ],
        "kernels": bench.kernels,
        "target_ratio": TARGET_RATIO,
        "overhead": summary,
    }
    print(json.dumps(doc, separators=(",", ":")), flush=True)
    return doc


if __name__ == "__main__":
    main()
