"""KV tier benchmark (``make bench-tier``): the load-back copy, and a working set 4x the pool with and
without the tier.

1. **Copy.** A tier (``KVTier``, a file-backed mmap in ``TMPDIR``) under a pool shaped as
   SmolLM2-135M's in bfloat16 (30 layers, 3 KV heads, head_dim 64, 16-token pages: 368,640 bytes a
   page): ``save`` (pool -> tier, what an eviction does) and ``load`` (tier -> pool, a hit) of
   ``n`` scattered pages, median of ``--reps``; ms per page and GB/s (1e9 bytes/s); and the first
   write of each tier page (which faults it in: the tier's file is sparse).
2. **Serving.** Two schedulers on the real model (``--model``, default SmolLM2-135M-Instruct), each
   with a pool of ``--pool-pages`` pages, one with a tier that can hold the working set and one
   without; ``--prompts`` distinct prompts of ``--prompt-len`` tokens (together ~4x the pool), each
   sent ``--rounds`` times in one seeded random order, one at a time (``max_new_tokens`` 1), to
   both schedulers in turn, request by request, so the machine's load falls alike on both. Reports
   the hit rate (cached prompt tokens / prompt tokens), TTFT p50 / mean (submit to first token,
   transport-free: the scheduler core only) and the tier's load-back time per page.

Prints a table, then as the last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.layers.native import cpu_description
from pdserve.mem_cache.kv_tier import KVTier
from pdserve.mem_cache.memory_pool import KVPool
from pdserve.model_source import resolve_model
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.req import Req
from pdserve.scheduler.scheduler import Scheduler, SchedulerConfig

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 30, 3, 64, 16


def copy_speed(num_pages: list[int], reps: int) -> dict:
    """The first ``save`` into every tier page (faults), then the median ``save`` and ``load`` of ``n``
    scattered pages of the warm tier, for each ``n``."""
    pool_pages = 2 * max(num_pages)
    pool = KVPool(pool_pages, PAGE_SIZE, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16)
    pool.kv_data.normal_()
    tier = KVTier(pool, pool_pages)
    start = time.perf_counter()  # the first write of each tier page faults it in (the file is sparse)
    tier.save(range(pool_pages), range(pool_pages))
    first_touch_ms = (time.perf_counter() - start) * 1e3 / pool_pages
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in num_pages:
        times: dict[str, list[float]] = {"save": [], "load": []}
        for _ in range(reps):
            src = torch.randperm(pool_pages, generator=gen)[:n].tolist()
            dst = torch.randperm(pool_pages, generator=gen)[:n].tolist()
            for kind, call in (("save", tier.save), ("load", tier.load)):
                start = time.perf_counter()
                call(src, dst)
                times[kind].append(time.perf_counter() - start)
        row = {"pages": n}
        for kind, samples in times.items():
            median = statistics.median(samples)
            row[f"{kind}_ms_per_page"] = median * 1e3 / n
            row[f"{kind}_gb_s"] = n * pool.page_nbytes / median / 1e9
        rows.append(row)
    return {"first_touch_save_ms_per_page": first_touch_ms, "pages": rows}


def first_token(sched: Scheduler, req: Req) -> float:
    """Serve ``req`` alone to its end; returns its TTFT (seconds from submit to its first token)."""
    start = time.perf_counter()
    sched.add_request(req)
    ttft = None
    while sched.has_work():
        batch = sched.schedule()
        if batch is not None:
            sched.process_result(batch, sched.run_batch(batch))
        if ttft is None and req.output_ids:
            ttft = time.perf_counter() - start
    return ttft


def serving(args: argparse.Namespace) -> dict:
    runners, scheds = {}, {}
    tier_pages = 2 * args.prompts * (args.prompt_len // PAGE_SIZE + 1)  # room for the whole working set
    for name in ("no tier", "tier"):
        runners[name] = runner = ModelRunner(
            resolve_model(args.model), page_size=PAGE_SIZE, max_total_tokens=args.pool_pages * PAGE_SIZE
        )
        tier_bytes = tier_pages * runner.kv_pool.page_nbytes if name == "tier" else 0
        scheds[name] = Scheduler(runner, SchedulerConfig(role="mixed", kv_tier_memory=tier_bytes))
    rng = random.Random(0)
    vocab = runners["tier"].model_config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    order = [i for i in range(args.prompts) for _ in range(args.rounds)]
    rng.shuffle(order)
    ttft: dict[str, list[float]] = {name: [] for name in scheds}
    cached = dict.fromkeys(scheds, 0)
    for n, i in enumerate(order):
        for name, sched in scheds.items():
            req = Req(f"{n}", list(prompts[i]), SamplingParams(max_new_tokens=1, temperature=0.0))
            ttft[name].append(first_token(sched, req))
            cached[name] += req.cached_tokens
    total = len(order) * args.prompt_len
    sample = scheds["tier"].metrics.registry.get_sample_value
    loads, load_s = sample("pdserve:kv_tier_load_seconds_count"), sample("pdserve:kv_tier_load_seconds_sum")
    pages_loaded = sample("pdserve:kv_tier_hit_tokens_total") / PAGE_SIZE
    out = {
        "working_set_over_pool": args.prompts * args.prompt_len / (args.pool_pages * PAGE_SIZE),
        "requests": len(order),
        "load_backs": loads,
        "load_back_ms_per_page": load_s * 1e3 / pages_loaded if pages_loaded else None,
    }
    for name in scheds:
        out[name] = {
            "hit_rate": cached[name] / total,
            "ttft_p50_s": statistics.median(ttft[name]),
            "ttft_mean_s": statistics.fmean(ttft[name]),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--pool-pages", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--copy-only", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {"cpu": cpu_description(), "copy": copy_speed([1, 16, 64, 256], args.reps)}
    print(f"CPU: {result['cpu']}")
    print(f"first write of a tier page: {result['copy']['first_touch_save_ms_per_page']:.3f} ms/page")
    print("pages  save ms/page  save GB/s  load ms/page  load GB/s")
    for row in result["copy"]["pages"]:
        print(
            f"{row['pages']:5d}  {row['save_ms_per_page']:12.4f}  {row['save_gb_s']:9.2f}"
            f"  {row['load_ms_per_page']:12.4f}  {row['load_gb_s']:9.2f}"
        )
    if not args.copy_only:
        result["serving"] = serving(args)
        s = result["serving"]
        print(
            f"working set {s['working_set_over_pool']:.1f}x the pool, {s['requests']} requests;"
            f" load-back {s['load_back_ms_per_page']} ms/page over {s['load_backs']} loads"
        )
        for name in ("no tier", "tier"):
            row = s[name]
            print(
                f"{name:8s} hit rate {row['hit_rate']:.3f}  TTFT p50 {row['ttft_p50_s'] * 1e3:.0f} ms"
                f"  mean {row['ttft_mean_s'] * 1e3:.0f} ms"
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
