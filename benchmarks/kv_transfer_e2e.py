"""KV transfer's share of TTFT in PD 1+1 (``make bench-kv-e2e``), sent after the last chunk or streamed.

For each configuration a PD 1+1 stack is launched (``pdserve launch --num-prefill 1 --num-decode 1``,
float32), its pools are churned by earlier traffic (``--churn`` requests of 16-1,500 random tokens, 4
at a time, so the radix caches hold scattered pages), then ``--reps`` fresh prompts of each length in
``--tokens`` run one at a time (random token ids: no cache hits). From the schedulers' metrics: the
decode side's TTFT (arrival to first token) and the prefill side's ``pdserve:kv_transfer_seconds``
(first token sampled to the last byte written: the part of TTFT the transfer adds), as means.

Configurations: ``after-last-chunk`` (a prompt's pages written once its last chunk has computed) and
``streamed`` (each chunk's pages written while later ones compute: the default). Prints a table and,
last, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from tests.stack import Stack, launch_stack

CONFIGS = {
    "after-last-chunk": {"PDSERVE_KV_STREAM_CHUNKS": "off"},
    "streamed": {"PDSERVE_KV_STREAM_CHUNKS": "on"},
}
VOCAB = (100, 49000)  # ordinary token ids of SmolLM2's vocabulary


def _generate(stack: Stack, ids: list[int], max_new_tokens: int) -> None:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    resp = httpx.post(f"{stack.base_url}/generate", json=body, timeout=600)
    resp.raise_for_status()


def _sums(stack: Stack) -> dict[str, float]:
    """Sum and count of TTFT (decode) and KV transfer time (prefill) so far."""
    m = stack.metrics()

    def total(name: str, role: str) -> float:
        return sum(v for k, v in m.get(name, {}).items() if k[0] == role)

    return {
        "ttft_sum": total("pdserve:time_to_first_token_seconds_sum", "decode"),
        "ttft_count": total("pdserve:time_to_first_token_seconds_count", "decode"),
        "kv_sum": total("pdserve:kv_transfer_seconds_sum", "prefill"),
        "kv_count": total("pdserve:kv_transfer_seconds_count", "prefill"),
    }


def _churn(stack: Stack, rng: np.random.Generator, n: int) -> None:
    """``n`` requests of random length, 4 at a time, each generating 4 tokens."""
    prompts = [rng.integers(*VOCAB, int(rng.integers(16, 1500))).tolist() for _ in range(n)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda ids: _generate(stack, ids, 4), prompts))


def _run_config(label: str, env: dict[str, str], args, seed: int) -> list[dict]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        stack = launch_stack(
            "--num-prefill", "1", "--num-decode", "1", "--dtype", "float32",
            "--max-total-tokens", str(args.max_total_tokens), log_name=f"bench-kv-e2e-{label}",
        )  # fmt: skip
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    rng = np.random.default_rng(seed)
    rows = []
    try:
        _churn(stack, rng, args.churn)
        stack.wait_idle(60)
        for tokens in args.tokens:
            before = _sums(stack)
            start = time.perf_counter()
            for _ in range(args.reps):
                _generate(stack, rng.integers(*VOCAB, tokens).tolist(), 2)
            wall = time.perf_counter() - start
            after = _sums(stack)
            d = {k: after[k] - before[k] for k in after}
            ttft = d["ttft_sum"] / max(d["ttft_count"], 1)
            kv = d["kv_sum"] / max(d["kv_count"], 1)
            rows.append(
                {
                    "config": label,
                    "tokens": tokens,
                    "requests": int(d["ttft_count"]),
                    "ttft_ms": round(ttft * 1e3, 1),
                    "kv_transfer_ms": round(kv * 1e3, 2),
                    "kv_share": round(kv / ttft, 4) if ttft else None,
                    "wall_s": round(wall, 1),
                }
            )
        stack.check_kv_conservation()
    finally:
        stack.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1000, 4000], help="prompt lengths")
    parser.add_argument("--reps", type=int, default=3, help="prompts per length")
    parser.add_argument("--churn", type=int, default=48, help="earlier requests that churn the pools")
    parser.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool per scheduler")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    rows = [row for label in args.configs for row in _run_config(label, CONFIGS[label], args, args.seed)]
    header = f"{'config':<8}{'tokens':>7}{'reqs':>6}{'TTFT ms':>10}{'KV ms':>9}{'KV share':>10}"
    print(header)
    print("-" * len(header))
    for r in rows:
        share = f"{100 * r['kv_share']:.2f}%" if r["kv_share"] is not None else "-"
        print(
            f"{r['config']:<8}{r['tokens']:>7}{r['requests']:>6}{r['ttft_ms']:>10.1f}"
            f"{r['kv_transfer_ms']:>9.2f}{share:>10}"
        )
    print("(means over the requests; KV ms = prefill's first token to the last byte of its KV written)")
    print(
        json.dumps(
            {
                "benchmark": "kv_transfer_e2e",
                "wall_s": round(time.perf_counter() - started, 1),
                "results": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
