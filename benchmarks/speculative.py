"""Speculative decoding at the engine: ``python -m benchmarks.speculative`` (``make bench-spec``).

1. Verify-step time: ``B`` requests with ``--prompt-len``-token prompts, one step verifying ``k``
   draft tokens each (``k = 0`` is a plain decode step), for every ``B`` of ``--batch-sizes`` and
   ``k`` of ``--ks``; the median of ``--repeats`` runs, the ``k`` values interleaved so a shared
   machine's noise hits them alike. From ``t(B, k)`` follows the break-even acceptance rate: with
   each draft accepted with probability ``a``, a step yields ``(1 - a^(k+1)) / (1 - a)`` tokens, so
   speculation pays where that exceeds ``t(B, k) / t(B, 0)`` (the table a scheduler's per-step
   policy reads).
2. N-gram drafting on two workloads of ``benchmarks.serving_lib.workload``: ``random`` prompts and
   ``grounded`` ones (answers copy spans of the prompt), sent as completion prompts, as ``make
   bench`` sends them. Greedy speculation yields exactly greedy decoding's tokens, so the greedy
   outputs (``--new-tokens``, EOS ignored as ``make bench`` does; and cut at the first EOS) are
   generated once, and each step of speculation is replayed on them: drafts proposed, drafts
   accepted, acceptance rate, mean accepted length (vLLM's: 1 + accepted / drafting steps).
3. Both together at batch 1: decode tok/s of plain greedy decoding and of n-gram speculation with
   ``--spec-k`` drafts, through the engine, per workload.

``--clock cpu`` times with the thread's CPU time on one thread (on a machine shared with other
work, wall time measures the neighbours too; CPU time of one thread still counts what the step
itself does, less their cache and memory-bandwidth pressure). Prints tables, then as the last line
one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.serving_lib.workload import PromptSource
from pdserve.engine.model_runner import ModelRunner
from pdserve.layers.native import cpu_description
from pdserve.model_source import resolve_model
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.sampling.verify import accept
from pdserve.speculative.ngram import NgramIndex, NgramProposer
from tests.engine.driver import Driver

GREEDY = SamplingParams(temperature=0.0)
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = time.perf_counter


def verify_step_times(runner: ModelRunner, batch: int, ks: list[int], prompt_len: int, repeats: int) -> dict:
    """``{k: median seconds}`` of one verify step of ``batch`` requests with ``k`` drafts each."""
    generator = torch.Generator().manual_seed(batch)
    vocab = runner.model_config.vocab_size
    driver = Driver(runner)
    seqs = [
        driver.add(torch.randint(0, vocab, (prompt_len,), generator=generator).tolist(), GREEDY)
        for _ in range(batch)
    ]
    driver.step([(s, None) for s in seqs])
    drafts = torch.randint(0, vocab, (batch, max(ks)), generator=generator).tolist()
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(repeats):
        for k in ks:  # the same slots rewritten each run: the context stays prompt_len + 1 long
            fb, inputs = driver.prepare_verify([(s, d[:k]) for s, d in zip(seqs, drafts, strict=True)])
            start = clock()
            accept(runner.forward_batch_generation(fb), inputs.drafts)
            times[k].append(clock() - start)
    driver.release(*seqs)
    return {k: statistics.median(t) for k, t in times.items()}


def break_even(ratio: float, k: int) -> float | None:
    """The acceptance rate ``a`` at which ``(1 - a^(k+1)) / (1 - a)`` tokens a step equal ``ratio``
    (the step's cost over a decode step's); 0 when it always pays, None when it never can."""
    if ratio <= 1:
        return 0.0
    if ratio >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if (1 - mid ** (k + 1)) / (1 - mid) < ratio:
            lo = mid
        else:
            hi = mid
    return hi


def greedy_outputs(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``new_tokens`` tokens (EOS ignored), 16 prompts a batch."""
    outputs = []
    driver = Driver(runner)
    for i in range(0, len(prompts), 16):
        seqs = [driver.add(p, GREEDY) for p in prompts[i : i + 16]]
        driver.generate(seqs, new_tokens)
        driver.release(*seqs)
        outputs += [s.output_ids for s in seqs]
    return outputs


def replay_ngram(
    prompt: list[int], output: list[int], k: int, min_n: int, max_n: int
) -> tuple[int, int, int]:
    """Speculation replayed on a greedy output: (steps, drafting steps, drafts proposed, accepted)
    after the first token (which the prefill samples)."""
    index = NgramIndex(min_n, max_n)
    index.extend(prompt + output[:1])
    steps = drafting = proposed = accepted = 0
    done = 1
    while done < len(output):
        draft = index.propose(min(k, len(output) - done - 1)) if done < len(output) - 1 else []
        a = 0
        while a < len(draft) and draft[a] == output[done + a]:
            a += 1
        steps, drafting = steps + 1, drafting + bool(draft)
        proposed, accepted = proposed + len(draft), accepted + a
        index.extend(output[done : done + a + 1])
        done += a + 1
    return steps, drafting, proposed, accepted


def ngram_stats(prompts, outputs, k: int, min_n: int, max_n: int, eos: set[int] | None) -> dict:
    """Totals of ``replay_ngram`` over the outputs (each cut after its first EOS when ``eos``)."""
    steps = drafting = proposed = accepted = tokens = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        if eos:
            output = output[: next((i + 1 for i, t in enumerate(output) if t in eos), len(output))]
        s, d, p, a = replay_ngram(prompt, output, k, min_n, max_n)
        steps, drafting, proposed, accepted, tokens = (
            steps + s,
            drafting + d,
            proposed + p,
            accepted + a,
            tokens + len(output) - 1,
        )
    return {
        "spec_decode_num_drafts": drafting,
        "spec_decode_num_draft_tokens": proposed,
        "spec_decode_num_accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_acceptance_length": 1 + accepted / drafting if drafting else 1.0,
        "tokens_per_step": tokens / steps if steps else 1.0,
        "drafting_steps_fraction": drafting / steps if steps else 0.0,
    }


def decode_speed(runner: ModelRunner, prompt: list[int], new_tokens: int, k: int) -> float:
    """Decode tok/s of one request after its prefill: plain greedy (``k = 0``) or n-gram speculation."""
    driver = Driver(runner)
    seq = driver.add(prompt, GREEDY)
    driver.step([(seq, None)])
    proposer = NgramProposer()
    start = clock()
    while len(seq.output_ids) < new_tokens:
        if k:
            driver.speculate([seq], proposer, min(k, new_tokens - len(seq.output_ids)))
        else:
            driver.step([(seq, None)])
    elapsed = clock() - start
    driver.release(seq)
    return (len(seq.output_ids) - 1) / elapsed


def step_table(runner: ModelRunner, spec: str, args: argparse.Namespace, results: dict) -> None:
    """Time verify steps for every batch size and ``k``; print the table and add it to ``results``."""
    ks = [int(k) for k in args.ks.split(",")]
    print(f"\n{spec}: verify step ms (k drafts per request); break-even acceptance rate in brackets")
    print(f"{'batch':>5} " + " ".join(f"{'k=' + str(k):>14}" for k in ks))
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        times = verify_step_times(runner, batch, ks, args.prompt_len, args.repeats)
        cells = []
        for k in ks:
            key = f"{spec.replace('+', '_')}_b{batch}_k{k}"
            even = break_even(times[k] / times[ks[0]], k) if k else 0.0
            results[f"{key}_ms"] = round(times[k] * 1e3, 2)
            results[f"{key}_break_even"] = None if even is None else round(even, 3)
            cells.append(f"{times[k] * 1e3:7.1f} ({'-' if even is None else f'{even:.2f}'})")
        print(f"{batch:>5} " + " ".join(f"{c:>14}" for c in cells))


def ngram_report(runner: ModelRunner, spec: str, args: argparse.Namespace, results: dict) -> None:
    """N-gram acceptance on both workloads' greedy outputs, and the batch-1 speeds; printed and added
    to ``results``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    eos = set(runner.model_config.eos_token_ids)
    print(f"\nn-gram drafting ({args.min_n}..{args.max_n}-gram, k = {args.spec_k}), greedy {spec} outputs")
    for kind in ("random", "grounded"):
        texts = PromptSource(kind, args.prompt_len, 1, seed=0).take(args.prompts)
        prompts = [tokenizer(t)["input_ids"] for t in texts]
        outputs = greedy_outputs(runner, prompts, args.new_tokens)
        for label, stop in (("ignore_eos", None), ("until_eos", eos)):
            stats = ngram_stats(prompts, outputs, args.spec_k, args.min_n, args.max_n, stop)
            results |= {f"ngram_{kind}_{label}_{key}": round(v, 4) for key, v in stats.items()}
            print(
                f"{kind:>9} {label:>10}: acceptance {stats['acceptance_rate']:.3f}, mean accepted length "
                f"{stats['mean_acceptance_length']:.2f}, tokens/step {stats['tokens_per_step']:.2f}, "
                f"drafting in {stats['drafting_steps_fraction']:.0%} of steps"
            )
        speeds = {}
        for k in (0, args.spec_k):
            speeds[k] = statistics.median(decode_speed(runner, p, args.new_tokens, k) for p in prompts[:4])
        results[f"e2e_b1_{kind}_plain_tok_s"] = round(speeds[0], 2)
        results[f"e2e_b1_{kind}_ngram_tok_s"] = round(speeds[args.spec_k], 2)
        plain, spec_speed = speeds[0], speeds[args.spec_k]
        print(f"{kind:>9} batch 1: plain {plain:.1f} tok/s, n-gram k={args.spec_k} {spec_speed:.1f} tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--dtypes", default="float32+w4a8,bfloat16", help="comma-separated DTYPE[+QUANT]")
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--ks", default="0,1,2,3,4,5,6,7,8", help="draft tokens per request to time")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="cpu: one thread's CPU time")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per workload for the n-gram replay")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--spec-k", type=int, default=4, help="draft tokens a step in the batch-1 runs")
    parser.add_argument("--min-n", type=int, default=1)
    parser.add_argument("--max-n", type=int, default=4)
    parser.add_argument("--skip-steps", action="store_true", help="only the n-gram part (first dtype)")
    parser.add_argument("--skip-ngram", action="store_true", help="only the verify-step tables")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    if args.threads or args.clock == "cpu":
        torch.set_num_threads(1 if args.clock == "cpu" else args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    max_k = max(int(k) for k in args.ks.split(","))
    results: dict = {"cpu": cpu_description(), "threads": torch.get_num_threads(), "clock": args.clock}
    print(f"{results['cpu']}, {results['threads']} threads, {args.clock} clock")
    for i, spec in enumerate(args.dtypes.split(",")):
        dtype, _, method = spec.partition("+")
        runner = ModelRunner(
            resolve_model(args.model),
            dtype=dtype,
            quantization=method or None,
            max_total_tokens=max(batches) * (args.prompt_len + max_k + 32)
            + 16 * (args.prompt_len * 2 + args.new_tokens * 2),
            max_running_requests=max(*batches, 16),
        )
        if not args.skip_steps:
            step_table(runner, spec, args, results)
        if i == 0 and not args.skip_ngram:
            ngram_report(runner, spec, args, results)
        del runner
    print(json.dumps(results))


if __name__ == "__main__":
    main()
