"""CPU paged attention: the C kernels beside gather + SDPA (``python -m benchmarks.attention_kernel``).

For each dtype, batch size ``B`` and sequence length ``L``: ``B`` requests of ``L`` cached tokens in
a KV pool shaped like one SmolLM2-135M layer (9 query heads, 3 KV heads, head_dim 64, 16-token
pages; flags change them), their pages scattered at random, one query each. Two ways to attend:
``cpu_decode_kernel`` reading the pages in place, and PyTorch's gather of each request's pages
followed by ``F.scaled_dot_product_attention`` (GQA, keys past each length masked). Successive
calls read different layers' pools (enough for 64 MiB of K/V, at most 8), so that, as in a decode
step over many layers, all but the smallest cases read K/V from memory, not from cache. Each time
is the lower quartile of ``--reps`` calls (calls stalled by other tenants of a shared machine drop
out), best of ``--repeats`` rounds in which the two alternate; ``KV GB/s`` is the K and V bytes the
kernel must read over its time.

Extends (``--extend-cases``, each of ``--dtypes``): ``R`` requests of ``N`` new tokens each after
``P`` cached ones, the cached pages shared by all requests (a common preamble), timed two ways: the
kernel with a row per new token (its request's pages, its position + 1 keys: how the CPU backend
runs every token, so a token is computed alike in any batch) and gather + causally masked SDPA.
Prints the tables (with the largest output difference from the kernel), then as the last line one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.layers.attention.cpu_decode_kernel import load_decode_kernel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CACHE_BYTES = 64 << 20  # K/V kept in play across calls: well past the last-level cache
MAX_LAYERS = 8


def gather_sdpa(q, k_pages, v_pages, page_table, seq_lens, scale: float) -> torch.Tensor:
    """The PyTorch path: copy each request's pages out of the pool, then one masked GQA SDPA.

    q: ``[B, Hq, D]``; pools ``[num_pages, page_size, Hkv, D]``; returns ``[B, Hq, D]``.
    """
    keys = k_pages[page_table].flatten(1, 2).transpose(1, 2)  # [B, Hkv, pages * page_size, D]
    values = v_pages[page_table].flatten(1, 2).transpose(1, 2)
    valid = torch.arange(keys.shape[2]) < seq_lens[:, None]  # [B, Lk]
    out = F.scaled_dot_product_attention(
        q[:, :, None], keys, values, attn_mask=valid[:, None, None], scale=scale, enable_gqa=True
    )
    return out[:, :, 0]


def quartile_ms(fn: Callable[[int], torch.Tensor], layers: int, reps: int) -> float:
    """Lower-quartile wall time of ``fn(layer)`` over ``reps`` calls, cycling through the layers."""
    fn(0)  # warm-up: first-touch page faults, the kernel's build, SDPA's dispatch
    times = []
    for i in range(reps):
        start = time.perf_counter()
        fn(i % layers)
        times.append(time.perf_counter() - start)
    return statistics.quantiles(times, n=4)[0] * 1e3


def bench_case(args, dtype: torch.dtype, batch: int, seq_len: int, generator: torch.Generator) -> dict:
    """Times (ms) of the kernel and of gather + SDPA on one case, the kernel's KV GB/s, and the
    largest difference between their outputs."""
    kernel = load_decode_kernel()
    assert kernel is not None, "the CPU decode kernel did not build (no C compiler?)"
    hkv, d, ps = args.kv_heads, args.head_dim, args.page_size
    pages_per_req = math.ceil(seq_len / ps)
    num_pages = batch * pages_per_req
    kv_bytes = 2 * batch * seq_len * hkv * d * dtype.itemsize
    layer_bytes = 2 * num_pages * ps * hkv * d * dtype.itemsize
    layers = max(1, min(MAX_LAYERS, math.ceil(CACHE_BYTES / layer_bytes)))
    shape = (num_pages, ps, hkv, d)
    pools = [
        (torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype))
        for _ in range(layers)
    ]
    page_table = torch.randperm(num_pages, generator=generator).view(batch, pages_per_req)
    seq_lens = torch.full((batch,), seq_len)
    q = torch.randn(batch, args.heads, d, generator=generator).to(dtype)
    scale = d**-0.5

    def run_kernel(layer: int) -> torch.Tensor:
        return kernel(q, *pools[layer], page_table, seq_lens, scale)

    def run_sdpa(layer: int) -> torch.Tensor:
        return gather_sdpa(q, *pools[layer], page_table, seq_lens, scale)

    reps = args.reps or max(5, min(200, (1 << 21) // (batch * seq_len)))
    kernel_ms, sdpa_ms = math.inf, math.inf
    for _ in range(args.repeats):
        kernel_ms = min(kernel_ms, quartile_ms(run_kernel, layers, reps))
        sdpa_ms = min(sdpa_ms, quartile_ms(run_sdpa, layers, reps))
    max_diff = (run_kernel(0).float() - run_sdpa(0).float()).abs().max().item()
    return {
        "kernel_ms": kernel_ms,
        "sdpa_ms": sdpa_ms,
        "speedup": sdpa_ms / kernel_ms,
        "kernel_kv_gb_s": kv_bytes / kernel_ms / 1e6,
        "max_abs_diff": max_diff,
    }


def bench_extend_case(
    args, dtype: torch.dtype, reqs: int, new: int, prefix: int, generator: torch.Generator
) -> dict:
    """Times (ms) of kernel rows and of gather + SDPA for ``reqs`` requests of ``new`` tokens after a
    shared ``prefix`` in ``dtype``, and the largest difference between them."""
    kernel = load_decode_kernel()
    hq, hkv, d, ps = args.heads, args.kv_heads, args.head_dim, args.page_size
    shared, own = prefix // ps, math.ceil((prefix + new) / ps) - prefix // ps
    num_pages = shared + reqs * own
    shape = (num_pages, ps, hkv, d)
    k_pages = torch.randn(shape, generator=generator).to(dtype)
    v_pages = torch.randn(shape, generator=generator).to(dtype)
    order = torch.randperm(num_pages, generator=generator)
    page_table = torch.cat([order[:shared].expand(reqs, -1), order[shared:].view(reqs, own)], dim=1)
    q = torch.randn(reqs * new, hq, d, generator=generator).to(dtype)
    row_req = torch.arange(reqs).repeat_interleave(new)
    row_lens = (prefix + torch.arange(new) + 1).repeat(reqs)
    positions = prefix + torch.arange(new)
    causal = torch.arange(page_table.shape[1] * ps)[None, :] <= positions[:, None]  # [new, Lk]
    scale = d**-0.5

    def run_rows() -> torch.Tensor:
        return kernel(q, k_pages, v_pages, page_table, row_lens, scale, row_req)

    def run_sdpa() -> torch.Tensor:
        keys = k_pages[page_table].flatten(1, 2).transpose(1, 2)  # [R, Hkv, Lk, D]
        values = v_pages[page_table].flatten(1, 2).transpose(1, 2)
        queries = q.view(reqs, new, hq, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=causal[None, None], scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(reqs * new, hq, d)

    reps = args.reps or max(3, min(50, (1 << 22) // (reqs * new * (prefix + new))))
    times = {"rows": math.inf, "sdpa": math.inf}
    for _ in range(args.repeats):
        for name, fn in (("rows", run_rows), ("sdpa", run_sdpa)):
            times[name] = min(times[name], quartile_ms(lambda _layer, fn=fn: fn(), 1, reps))
    return {
        "rows_ms": times["rows"],
        "sdpa_ms": times["sdpa"],
        "sdpa_speedup": times["sdpa"] / times["rows"],
        "sdpa_max_diff": (run_sdpa().float() - run_rows().float()).abs().max().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--seq-lens", default="128,512,2048")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--extend-cases",
        default="16x31@1008,4x128@0,1x512@1024",
        help="extend cases REQUESTSxNEW@CACHED_PREFIX, comma-separated ('' for none)",
    )
    parser.add_argument("--heads", type=int, default=9, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's)")
    parser.add_argument("--reps", type=int, default=None, help="calls per timing (default: by size)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds; the best counts")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    results: dict[str, float | int] = {"threads": torch.get_num_threads()}
    print(
        f"{'dtype':>9} {'batch':>5} {'seq':>5} {'kernel ms':>10} {'SDPA ms':>9} {'speedup':>8}"
        f" {'KV GB/s':>8} {'max diff':>9}"
    )
    for name in args.dtypes.split(","):
        for batch in map(int, args.batch_sizes.split(",")):
            for seq_len in map(int, args.seq_lens.split(",")):
                case = bench_case(args, DTYPES[name], batch, seq_len, generator)
                results |= {f"{name}_b{batch}_s{seq_len}_{k}": v for k, v in case.items()}
                print(
                    f"{name:>9} {batch:>5} {seq_len:>5} {case['kernel_ms']:>10.3f} {case['sdpa_ms']:>9.3f}"
                    f" {case['speedup']:>8.2f} {case['kernel_kv_gb_s']:>8.1f} {case['max_abs_diff']:>9.1e}",
                    flush=True,
                )
    cases = [c for c in args.extend_cases.split(",") if c]
    for name in args.dtypes.split(",") if cases else []:
        print(f"\n{'extend ' + name:>16} {'rows ms':>8} {'SDPA ms':>8} {'x SDPA':>7} {'SDPA diff':>9}")
        for case in cases:
            shape, prefix = case.split("@")
            reqs, new = map(int, shape.split("x"))
            r = bench_extend_case(args, DTYPES[name], reqs, new, int(prefix), generator)
            results |= {f"extend_{name}_{reqs}x{new}_p{prefix}_{k}": v for k, v in r.items()}
            print(
                f"{case:>16} {r['rows_ms']:>8.3f} {r['sdpa_ms']:>8.3f} {r['sdpa_speedup']:>7.2f}"
                f" {r['sdpa_max_diff']:>9.1e}",
                flush=True,
            )
    print(json.dumps({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in results.items()}))


if __name__ == "__main__":
    main()
