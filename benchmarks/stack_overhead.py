"""The serving path's own ceiling: ``make bench-stack`` (``python -m benchmarks.stack_overhead``).

Serves a near-free model (``serving_lib.tiny_model``: a random-weight Llama of 2 layers and hidden
size 128 with the default tokenizer, built once in the cache; ``--model`` for any checkpoint) through
the whole stack, colocated and PD 1+1, and drives the same scheduler in-process beside it (the
``gateway_overhead`` comparison: same prompts, same statistics, sides alternating), at fixed
concurrencies (default 64 and 256, 512 requests of 128 prompt / 64 output tokens per level). With
the model nearly free, what remains is what the serving path costs: output tok/s and req/s of the
stack and of the scheduler alone, their ratio, the client's TTFT / ITL percentiles, and CPU
milliseconds per output token of every service (gateway, tokenizer, detokenizer, prefill, decode),
of the HTTP client and of the in-process scheduler.

``--checkout LABEL=PATH`` (repeatable) runs the same measurement for other checkouts of pdserve in one
run, each with its own ``PATH/.venv`` (``make install`` there), configuration by configuration in
turn: before / after comparisons on a shared machine. ``--profile DIR`` samples every service (and
the in-process scheduler) with py-spy during the first round and adds each one's hottest functions
to the JSON. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch
from tabulate import tabulate

from benchmarks.gateway_overhead import OverheadBench, OverheadConfig
from benchmarks.serving_lib.in_process import InProcessServer
from benchmarks.serving_lib.launch import LaunchSpec, launched
from benchmarks.serving_lib.overhead import HTTP, SideRun, summarize_overhead
from benchmarks.serving_lib.procs import rerun_with_scheduler_env
from benchmarks.serving_lib.profiles import profiled, summarize_profile
from benchmarks.serving_lib.tiny_model import tiny_checkpoint
from pdserve.tokenization import Tokenizer

log = logging.getLogger("benchmarks.stack_overhead")

CONFIGS = {"colocated": "--colocated", "pd": "--num-prefill 1 --num-decode 1"}
ROLES = ("gateway", "tokenizer", "detokenizer", "prefill", "decode")
THIS = "this"


def role_cpu_ms(runs: list[SideRun]) -> dict[str, float]:
    """CPU ms per output token of each service role (replicas summed), of all services together
    (``services``) and of the client (``client``), over ``runs`` (http runs of one level)."""
    tokens = sum(r.result.mean_output_tokens * r.result.completed for r in runs)
    cpu: dict[str, float] = {}
    for run in runs:
        for name, seconds in run.cpu_s.items():
            role = "client" if name == "bench" else name.split("-")[0]
            cpu[role] = cpu.get(role, 0.0) + seconds
    cpu["services"] = sum(v for k, v in cpu.items() if k != "client")
    return {k: round(1000 * v / tokens, 3) for k, v in cpu.items()} if tokens else {}


def summarize(checkout: str, config: str, runs: list[SideRun], profiles: dict) -> list[dict]:
    """One row per level: throughputs, ratio, client latencies and CPU per token (see module doc)."""
    rows = []
    for level in summarize_overhead(runs):
        c = level["level"]
        http = [r for r in runs if r.result.label == HTTP and r.result.level == c]
        first = http[0].result
        in_process_ms = level["cpu_ms_per_token"]["in_process"]
        rows.append(
            {
                "checkout": checkout,
                "config": config,
                "concurrency": c,
                "http_tok_s": level["http_tok_s"],
                "in_process_tok_s": level["in_process_tok_s"],
                "ratio": level["ratio"],
                "http_req_s": round(sum(r.result.request_throughput for r in http) / len(http), 3),
                "ttft_ms": first.ttft_ms,
                "itl_ms": first.itl_ms,
                "errors": sum(r.result.errors for r in http),
                "cpu_ms_per_token": role_cpu_ms(http) | {"in_process": in_process_ms},
                "profile": profiles.get(c, {}),
            }
        )
    return rows


class _Profiler:
    """``around_side`` for ``OverheadBench``: py-spy on the stack's services (http) or on this process
    (in-process) during round 0; summaries by level in ``by_level``."""

    def __init__(self, out_dir: Path, tag: str, services: dict[str, psutil.Process]) -> None:
        self.out_dir, self.tag, self.services = out_dir, tag, services
        self.by_level: dict[int, dict] = {}

    @contextmanager
    def __call__(self, side: str, level: int, rnd: int) -> Iterator[None]:
        if rnd != 0:
            yield
            return
        procs = self.services if side == HTTP else {"in_process": psutil.Process()}
        with profiled(procs, self.out_dir, f"{self.tag}-c{level}-{side}") as paths:
            yield
        self.by_level.setdefault(level, {}).update({k: summarize_profile(p) for k, p in paths.items()})


def run_here(args: argparse.Namespace, checkout: str) -> list[dict]:
    """Every configuration of ``args`` with the pdserve this interpreter imports."""
    model = args.model or str(tiny_checkpoint())
    common = f"--model {shlex.quote(model)} {args.flags}".strip()
    cfg = OverheadConfig.from_args(args)
    with ThreadPoolExecutor(1) as pool:  # a thread that ends before the run (InProcessServer's advice)
        server = pool.submit(InProcessServer.from_launch_flags, shlex.split(f"--colocated {common}")).result()
    tokenizer = Tokenizer.load(str(server.model_dir))
    rows = []
    for config in args.configs.split(","):
        with launched(LaunchSpec(f"stack-{checkout}-{config}", f"{CONFIGS[config]} {common}")) as stack:
            bench = OverheadBench(stack, server, tokenizer, cfg)
            profiler = None
            if args.profile:
                services = {k: v for k, v in bench.processes.items() if k != "bench"}
                profiler = bench.around_side = _Profiler(Path(args.profile), f"{checkout}-{config}", services)
            runs = asyncio.run(bench.run())
        rows += summarize(checkout, config, runs, profiler.by_level if profiler else {})
    return rows


def run_checkout(args: argparse.Namespace, label: str, path: str, config: str) -> list[dict]:
    """One configuration with the checkout at ``path`` (its ``.venv``), in a subprocess; its rows."""
    python = Path(path) / ".venv" / "bin" / "python"
    argv = [str(python), "-m", "benchmarks.stack_overhead", "--here", label, "--configs", config]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if _forwarded(k, v)]
    log.info("%s (%s): %s", label, path, config)
    out = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    return json.loads(out.stdout.strip().splitlines()[-1])["rows"]


def _forwarded(key: str, value) -> bool:
    return key not in ("checkout", "here", "configs") and value not in (None, False, "")


def table(rows: list[dict]) -> str:
    headers = ["checkout", "config", "c", "http tok/s", "in-proc tok/s", "ratio", "req/s"]
    headers += ["TTFT p50", "TTFT p99", "ITL p50", "ITL p99"]
    cpu_keys = [*ROLES, "services", "client", "in_process"]
    headers += [f"cpu ms/tok {k.replace('_', '-')}" for k in cpu_keys]
    body = [
        [r["checkout"], r["config"], r["concurrency"], r["http_tok_s"], r["in_process_tok_s"], r["ratio"]]
        + [r["http_req_s"], r["ttft_ms"]["p50"], r["ttft_ms"]["p99"], r["itl_ms"]["p50"], r["itl_ms"]["p99"]]
        + [r["cpu_ms_per_token"].get(k) for k in cpu_keys]
        for r in rows
    ]
    return tabulate(body, headers=headers, floatfmt=".3g", missingval="-")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.stack_overhead", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", help="checkpoint directory or .gguf (default: the tiny random-weight Llama)")
    p.add_argument("--configs", default="colocated,pd", help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument(
        "--flags",
        # the default queue bound (sized from the pool) refuses part of a 256-request burst in process
        default="--max-queued-requests 1024",
        help="more pdserve launch flags for every stack and the scheduler",
    )
    p.add_argument("--concurrency", default="64,256", help="comma-separated concurrency levels")
    p.add_argument("--num-requests", type=int, default=512, help="requests per level and side")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="repeats of every level, sides alternating")
    p.add_argument("--warmup", type=int, default=8, help="uncounted requests per side first")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--threads", type=int, help="torch threads of every scheduler (default: torch's)")
    p.add_argument("--profile", metavar="DIR", help="py-spy every process in round 0; raw profiles in DIR")
    p.add_argument("--checkout", action="append", metavar="LABEL=PATH", help="another pdserve checkout")
    p.add_argument("--here", metavar="LABEL", help=argparse.SUPPRESS)  # a --checkout's subprocess
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("benchmarks").setLevel(logging.INFO)
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.here or not args.checkout:  # this process drives a scheduler: the stack's OpenMP settings
        rerun_with_scheduler_env("benchmarks.stack_overhead", argv)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by every process of the stacks
    if args.here or not args.checkout:
        rows = run_here(args, args.here or THIS)
    else:
        checkouts = [c.partition("=")[::2] for c in args.checkout]
        rows = [
            row
            for config in args.configs.split(",")
            for label, path in checkouts
            for row in run_checkout(args, label, path, config)
        ]
    if not args.here:
        print(table(rows))
    settings = {k: v for k, v in vars(args).items() if k != "here"} | {"threads": threads}
    doc = {"config": settings, "rows": rows}
    print(json.dumps(doc, separators=(",", ":")), flush=True)
    return doc


if __name__ == "__main__":
    main()
