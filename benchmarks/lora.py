"""Multi-LoRA decode throughput at the engine: ``python -m benchmarks.lora`` (``make bench-lora``).

One ``ModelRunner`` (``make run``'s defaults: ``--dtype auto``, ``--quantization auto``, w4a8 on
CPUs) with ``--max-loras`` slots holds random rank-``--rank`` adapters on all seven projections
(written in PEFT's format from the base's own shapes). A batch of ``--batch-size`` requests of
``--prompt-len`` random tokens is prefilled, then decoded for ``--new-tokens`` steps, its requests
spread round-robin over ``N`` adapters for each ``N`` of ``--adapters`` (0: the base model alone).
Decode throughput is ``B / median decode-step seconds``, best of ``--repeats`` rounds that take the
settings in turn (a shared machine's load varies alike under each). Prints a table, then one JSON
line with every number and each setting's ratio to the base model's.

A batch with any adapter token runs the layers as modules (the fused C decoder applies no LoRA:
``docs/lora.md``), so the ratios include leaving that call as well as the deltas' matmuls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.serving_lib.adapters import write_adapter
from pdserve.engine.model_runner import ModelRunner
from pdserve.layers.native import cpu_description
from pdserve.model_source import resolve_model
from tests.engine.driver import Driver


def decode_rate(runner: ModelRunner, prompts: list[list[int]], slots: list[int], new_tokens: int) -> float:
    """Decode tokens/s of ``prompts`` (request i under adapter slot ``slots[i]``): one extend, then
    ``new_tokens - 1`` timed decode steps."""
    driver = Driver(runner)
    seqs = [driver.add(p, lora_slot=s) for p, s in zip(prompts, slots, strict=True)]
    work = [(seq, None) for seq in seqs]
    driver.step(work)
    times = []
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        driver.step(work)
        times.append(time.perf_counter() - start)
    driver.release(*seqs)
    return len(prompts) / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", default="0,1,4,16", help="adapters in the batch (0: the base model)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    counts = [int(n) for n in args.adapters.split(",")]
    runner = ModelRunner(
        resolve_model(), dtype=args.dtype, quantization=args.quantization, max_total_tokens=16384,
        max_running_requests=args.batch_size, max_loras=max(max(counts), 1), max_lora_rank=args.rank,
    )  # fmt: skip
    manager = runner.lora_manager
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(max(counts)):
            manager.add(f"a{i}", write_adapter(Path(scratch) / f"a{i}", manager.shapes, args.rank, seed=i))
    slots = [manager.acquire(f"a{i}") for i in range(max(counts))]  # every adapter resident
    gen = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    prompts = torch.randint(0, vocab, (args.batch_size, args.prompt_len), generator=gen).tolist()
    best = dict.fromkeys(counts, 0.0)
    for _ in range(args.repeats):
        for n in counts:
            request_slots = [slots[i % n] if n else -1 for i in range(args.batch_size)]
            best[n] = max(best[n], decode_rate(runner, prompts, request_slots, args.new_tokens))
    base = best.get(0)
    print(f"{cpu_description()}; batch {args.batch_size}, rank {args.rank}, {runner.model_config.dtype}")
    print(f"{'adapters':>8} {'decode tok/s':>13} {'vs base':>8}")
    for n in counts:
        ratio = f"{best[n] / base:.2f}" if base else "-"
        print(f"{n:>8} {best[n]:>13.1f} {ratio:>8}")
    ratios = {n: best[n] / base for n in counts} if base else None
    summary = {"cpu": cpu_description(), "batch_size": args.batch_size, "rank": args.rank}
    print(json.dumps(summary | {"decode_tok_s": best, "vs_base": ratios}))


if __name__ == "__main__":
    main()
