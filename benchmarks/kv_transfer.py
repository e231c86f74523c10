"""KV transfer benchmark (``make bench-kv``): page transfers beside a raw NIXL WRITE and memcpy.

A prefill-role process (this one) transfers the KV pages of one prompt into a decode-role child process
(multiprocessing spawn, UCX over loopback on CPU) with ``KVTransferAgent`` over page-major pools (one
NIXL descriptor per run of pages consecutive on both sides, every layer's K and V in it), timed until
the decode side has every page: the WRITE completes on the prefill side, which says so over the pipe
(as the Prefill call's answer does in the product), and the decode side counts its LANDED
notifications. In the same run, for the same bytes: a raw NIXL WRITE of one
contiguous buffer (the wire's speed; the decode side busy-polls for its notification) and a local copy
(memcpy).

Pools are sized like SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, page 16 tokens). Placements:
``contiguous`` (pages 0..n-1 on both sides), ``scattered`` (random distinct pages on both sides),
``after-churn`` (each side's pages from the real ``PagedTokenToKVPoolAllocator`` after a random history
of allocations and frees, as a long-running server's allocator hands them out), and ``head-slice``
(scattered pages, KV heads 0-1 of the 3 only: what a prefill rank writes into a decode rank of another
TP size, one descriptor per ``(page, layer, kv, slot)`` row; its bytes are two thirds of the others').

Prints a table of GB/s (1e9 bytes/s, median of ``--reps``) and, as the last line, one JSON object.
``--device cuda`` runs the same VRAM to VRAM on one GPU (both processes on it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection

import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from pdserve.kv_transfer import HeadSlice, KVLayout, KVTransferAgent
from pdserve.mem_cache.memory_pool import PagedTokenToKVPoolAllocator

logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO lines go to stdout, among the table

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 30, 3, 64, 16
NUM_PAGES = 512  # pool pages: room for a 4,000-token prompt, scattered
HEAD_SLICE = HeadSlice(src_head=0, dst_head=0, num_heads=2)  # the head-slice placement's heads


def _layout(dtype: str) -> KVLayout:
    return KVLayout("SmolLM2-135M-Instruct", dtype, PAGE_SIZE, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM)


def _pool(dtype: str, device: str) -> torch.Tensor:
    shape = (NUM_PAGES, NUM_LAYERS, 2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, device=device).to(getattr(torch, dtype))


def _raw_agent(name: str, pool: torch.Tensor) -> nixl_agent:
    """A plain NIXL agent (same settings as KVTransferAgent's) over the same pool, for the raw baseline."""
    config = nixl_agent_config(
        enable_prog_thread=False, backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    agent = nixl_agent(name, config)
    agent.register_memory(pool)
    return agent


def after_churn(rng: np.random.Generator, n: int, steps: int = 4000, occupancy: float = 0.85) -> list[int]:
    """``n`` pages from a real allocator of ``NUM_PAGES`` pages after ``steps`` random allocations
    (1-63 pages, as requests of 16-1,000 tokens) and frees (of a random live request, always once
    ``occupancy`` of the pool is taken, else with probability 0.3), the live ones then freed at
    random until ``n`` pages are free: a busy server's pool."""
    allocator = PagedTokenToKVPoolAllocator(NUM_PAGES, PAGE_SIZE)
    live: list[list[int]] = []
    for _ in range(steps):
        full = allocator.available_size() < NUM_PAGES * (1 - occupancy)
        if live and (full or rng.random() < 0.3):
            allocator.free(live.pop(int(rng.integers(len(live)))))
        elif pages := allocator.alloc(int(rng.integers(1, 64))):
            live.append(pages)
    while allocator.available_size() < n:
        allocator.free(live.pop(int(rng.integers(len(live)))))
    return allocator.alloc(n)


def _decode_main(conn: Connection, device: str) -> None:
    """Decode role: one pool per dtype; expect transfers on command, or progress raw ones."""
    torch.set_num_threads(1)
    loop = asyncio.new_event_loop()  # one for every receive, as a scheduler process has
    while (cmd := conn.recv())[0] == "setup":
        dtype = cmd[1]
        pool = _pool(dtype, device)
        agent = KVTransferAgent(f"bench-decode-{dtype}", pool, _layout(dtype))
        raw = _raw_agent(f"bench-decode-raw-{dtype}", pool)
        conn.send((agent.local_info(), raw.get_agent_metadata()))
        agent.add_peer(conn.recv())
        while (cmd := conn.recv())[0] != "done":
            if cmd[0] == "expect":  # (peer, tid, dst pages): register, say so, then await every page
                receive = agent.expect(*cmd[1:])
                conn.send("ready")
                conn.recv()  # the sender's "written", as a Prefill call's answer
                loop.run_until_complete(receive.wait(60))
            else:  # ("raw",): progress until the raw WRITE's notification arrived
                conn.send("ready")
                while not any(raw.get_new_notifs().values()):
                    time.sleep(0.0002)
            conn.send("ok")
        agent.close()


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


async def _pd_once(
    agent: KVTransferAgent, peer: str, conn: Connection, src, dst, tid: bytes, heads: HeadSlice | None
) -> tuple[float, int]:
    """Seconds until the decode side has every page (of ``heads`` only, when given), and the NIXL
    descriptors the transfer posted."""
    senders = {agent.name: heads.num_heads} if heads else agent.name
    conn.send(("expect", senders, tid, dst))
    conn.recv()
    start = time.perf_counter()
    transfer = agent.start_transfer(peer, tid, dst, stall_s=60, heads=heads)
    transfer.send(src, 0)
    transfer.finish()
    await transfer.wait(60)
    conn.send(("written",))
    conn.recv()
    return time.perf_counter() - start, transfer.descriptors


def _raw_once(
    raw: nixl_agent, peer: str, local: int, remote: int, nbytes: int, conn: Connection, mem: str
) -> float:
    conn.send(("raw",))
    conn.recv()
    start = time.perf_counter()
    handle = raw.initialize_xfer(
        "WRITE",
        raw.get_xfer_descs([(local, nbytes, 0)], mem),
        raw.get_xfer_descs([(remote, nbytes, 0)], mem),
        peer,
        b"raw",
    )
    state = raw.transfer(handle)
    while state == "PROC":
        state = raw.check_xfer_state(handle)
    conn.recv()
    seconds = time.perf_counter() - start
    handle.release()
    if state != "DONE":
        raise RuntimeError(f"raw NIXL transfer ended in state {state}")
    return seconds


def _memcpy_once(pool: torch.Tensor, scratch: torch.Tensor, nbytes: int) -> float:
    src = pool.view(-1).view(torch.uint8)[:nbytes]
    start = time.perf_counter()
    scratch[:nbytes].copy_(src)
    if pool.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


async def _bench_dtype(args, dtype: str, conn: Connection, rng: np.random.Generator) -> list[dict]:
    """Every repetition runs the raw WRITE, the memcpy and each placement once, interleaved, so all see
    the same machine load."""
    pool = _pool(dtype, args.device)
    agent = KVTransferAgent(f"bench-prefill-{dtype}", pool, _layout(dtype))
    raw = _raw_agent(f"bench-prefill-raw-{dtype}", pool)
    conn.send(("setup", dtype))
    peer, raw_metadata = conn.recv()
    agent.add_peer(peer)
    conn.send(agent.local_info())
    raw_peer = raw.add_remote_agent(raw_metadata).decode()
    mem = "VRAM" if pool.is_cuda else "DRAM"
    scratch = torch.empty(pool.numel() * pool.element_size(), dtype=torch.uint8, device=pool.device)
    results = []
    for tokens in args.tokens:
        n = math.ceil(tokens / PAGE_SIZE)
        nbytes = n * _layout(dtype).page_bytes
        placements = {
            "contiguous": (list(range(n)), list(range(n))),
            "scattered": (
                rng.choice(NUM_PAGES, n, replace=False).tolist(),
                rng.choice(NUM_PAGES, n, replace=False).tolist(),
            ),
            "after-churn": (after_churn(rng, n), after_churn(rng, n)),
        }
        placements["head-slice"] = placements["scattered"]
        heads = {p: HEAD_SLICE if p == "head-slice" else None for p in placements}
        sizes = {p: nbytes * HEAD_SLICE.num_heads // NUM_KV_HEADS if heads[p] else nbytes for p in placements}
        raw_s, memcpy_s = [], []
        pd_s: dict[str, list[float]] = {p: [] for p in placements}
        descriptors = {}
        for rep in range(args.reps + 1):  # repetition 0 warms up (connection, page faults) and is dropped
            raw_s.append(_raw_once(raw, raw_peer, pool.data_ptr(), peer.base_addr, nbytes, conn, mem))
            memcpy_s.append(_memcpy_once(pool, scratch, nbytes))
            for placement, (src, dst) in placements.items():
                tid = f"{tokens}-{placement}-{rep}".encode()
                seconds, descriptors[placement] = await _pd_once(
                    agent, peer.agent_name, conn, src, dst, tid, heads[placement]
                )
                pd_s[placement].append(seconds)
        raw_gbps = _gbps(nbytes, raw_s[1:])
        for placement in placements:
            gbps = _gbps(sizes[placement], pd_s[placement][1:])
            results.append(
                {
                    "dtype": dtype,
                    "tokens": tokens,
                    "pages": n,
                    "bytes": sizes[placement],
                    "placement": placement,
                    "descriptors": descriptors[placement],
                    "gbps": round(gbps, 3),
                    "ms": round(statistics.median(pd_s[placement][1:]) * 1e3, 3),
                    "vs_raw": round(gbps / raw_gbps, 3),
                    "raw_nixl_gbps": round(raw_gbps, 3),
                    "memcpy_gbps": round(_gbps(nbytes, memcpy_s[1:]), 3),
                }
            )
    conn.send(("done",))
    agent.close()
    return results


def _print_table(results: list[dict]) -> None:
    header = (
        f"{'dtype':<9}{'tokens':>7}{'MB':>7} {'placement':<12}{'descs':>6}{'ms':>8}{'GB/s':>6}{'/raw':>6}"
        f"{'raw':>6}{'memcpy':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['dtype']:<9}{r['tokens']:>7}{r['bytes'] / 1e6:>7.1f} {r['placement']:<12}"
            f"{r['descriptors']:>6}{r['ms']:>8.2f}{r['gbps']:>6.2f}{r['vs_raw']:>6.2f}{r['raw_nixl_gbps']:>6.2f}"
            f"{r['memcpy_gbps']:>7.2f}"
        )
    print(
        "(GB/s = 1e9 bytes/s until the decode side has every page, median of the repetitions;"
        " descs = NIXL descriptors per transfer; raw = one-buffer NIXL WRITE)"
    )


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0] if names else 'unknown CPU'} x{len(names)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1000, 4000], help="prompt lengths")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=11, help="repetitions per measurement (median reported)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="pools in DRAM or VRAM")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if max(args.tokens) > NUM_PAGES * PAGE_SIZE // 2:
        parser.error(f"--tokens at most {NUM_PAGES * PAGE_SIZE // 2}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a visible GPU")
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    decode = ctx.Process(target=_decode_main, args=(child_conn, args.device), daemon=True)
    decode.start()
    child_conn.close()
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    try:
        results = [r for dtype in args.dtypes for r in asyncio.run(_bench_dtype(args, dtype, conn, rng))]
    finally:
        conn.send(("exit",))
        decode.join(30)
    _print_table(results)
    summary = {
        "benchmark": "kv_transfer",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else _cpu_name(),
        "model_geometry": {"num_layers": NUM_LAYERS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM},
        "page_size": PAGE_SIZE,
        "reps": args.reps,
        "wall_s": round(time.perf_counter() - started, 1),
        "results": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
