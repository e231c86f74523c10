"""KV transfer benchmark (``make bench-kv``): the PD ``write_pages`` path beside raw NIXL and memcpy.

A prefill-role process (this one) WRITEs the KV pages of one prompt into a decode-role child process
(multiprocessing spawn, UCX over loopback) with ``KVTransferAgent.write_pages``. Pools are sized like
SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, page 16 tokens). In the same run, for the same bytes:
a raw NIXL WRITE of one contiguous buffer (busy-polled), and a local ``torch`` copy (memcpy).
Page placement is ``contiguous`` (pages 0..n-1 on both sides: 60 descriptors) or ``scattered``
(random distinct pages on both sides: one descriptor per page, layer and k/v).

Prints a table of GB/s (1e9 bytes/s, median of ``--reps``) and, as the last line, one JSON object.
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

from pdserve.kv_transfer import KVLayout, KVTransferAgent, coalesce

logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO lines go to stdout, among the table

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 30, 3, 64, 16
NUM_PAGES = 512  # pool pages per (layer, k/v) plane: room for a 4,000-token prompt, scattered


def _layout(dtype: str) -> KVLayout:
    return KVLayout("SmolLM2-135M-Instruct", dtype, PAGE_SIZE, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM)


def _pool(dtype: str) -> torch.Tensor:
    shape = (NUM_LAYERS, 2, NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape).to(getattr(torch, dtype))


def _raw_agent(name: str, pool: torch.Tensor) -> nixl_agent:
    """A plain NIXL agent (same settings as KVTransferAgent's) over the same pool, for the raw baseline."""
    config = nixl_agent_config(
        enable_prog_thread=False, backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    agent = nixl_agent(name, config)
    agent.register_memory(pool)
    return agent


def _decode_main(conn: Connection) -> None:
    """Decode role: expose a pool per dtype; await PD notifications or progress raw ones on command."""
    torch.set_num_threads(1)
    while (cmd := conn.recv())[0] == "setup":
        dtype = cmd[1]
        pool = _pool(dtype)
        agent = KVTransferAgent(f"bench-decode-{dtype}", pool, _layout(dtype))
        raw = _raw_agent(f"bench-decode-raw-{dtype}", pool)
        conn.send((agent.local_info(), raw.get_agent_metadata()))
        while (cmd := conn.recv())[0] != "done":
            if cmd[0] == "wait":
                for msg in cmd[1]:
                    asyncio.run(agent.wait_for_notification(msg, timeout_s=60))
            else:  # ("raw", n): make progress until n notifications arrived
                got = 0
                while got < cmd[1]:
                    got += sum(len(msgs) for msgs in raw.get_new_notifs().values())
                    time.sleep(0.001)
            conn.send("ok")
        agent.close()


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


async def _pd_once(agent: KVTransferAgent, peer: str, conn: Connection, src, dst, msg: bytes) -> float:
    conn.send(("wait", [msg]))
    start = time.perf_counter()
    await agent.write_pages(peer, src, dst, msg, timeout_s=60)
    seconds = time.perf_counter() - start
    conn.recv()
    return seconds


def _raw_once(raw: nixl_agent, peer: str, local: int, remote: int, nbytes: int, conn: Connection) -> float:
    conn.send(("raw", 1))
    start = time.perf_counter()
    handle = raw.initialize_xfer(
        "WRITE",
        raw.get_xfer_descs([(local, nbytes, 0)], "DRAM"),
        raw.get_xfer_descs([(remote, nbytes, 0)], "DRAM"),
        peer,
        b"raw",
    )
    state = raw.transfer(handle)
    while state == "PROC":
        state = raw.check_xfer_state(handle)
    seconds = time.perf_counter() - start
    handle.release()
    if state != "DONE":
        raise RuntimeError(f"raw NIXL transfer ended in state {state}")
    conn.recv()
    return seconds


def _memcpy_once(pool: torch.Tensor, scratch: torch.Tensor, nbytes: int) -> float:
    src = pool.view(-1).view(torch.uint8)[:nbytes]
    start = time.perf_counter()
    scratch[:nbytes].copy_(src)
    return time.perf_counter() - start


async def _bench_dtype(dtype: str, tokens_list: list[int], reps: int, conn: Connection, rng) -> list[dict]:
    """Every repetition runs each method once, interleaved, so all see the same machine load."""
    pool = _pool(dtype)
    agent = KVTransferAgent(f"bench-prefill-{dtype}", pool, _layout(dtype))
    raw = _raw_agent(f"bench-prefill-raw-{dtype}", pool)
    conn.send(("setup", dtype))
    info, raw_metadata = conn.recv()
    agent.add_peer(info)
    raw_peer = raw.add_remote_agent(raw_metadata).decode()
    scratch = torch.zeros(pool.numel() * pool.element_size(), dtype=torch.uint8)
    results = []
    for tokens in tokens_list:
        n = math.ceil(tokens / PAGE_SIZE)
        nbytes = n * _layout(dtype).page_bytes * NUM_LAYERS * 2
        placements = {
            "contiguous": (list(range(n)), list(range(n))),
            "scattered": (
                rng.choice(NUM_PAGES, n, replace=False).tolist(),
                rng.choice(NUM_PAGES, n, replace=False).tolist(),
            ),
        }
        raw_s, memcpy_s, pd_s = [], [], {placement: [] for placement in placements}
        for rep in range(reps + 1):  # repetition 0 warms up (connection, page faults) and is dropped
            raw_s.append(_raw_once(raw, raw_peer, pool.data_ptr(), info.base_addr, nbytes, conn))
            memcpy_s.append(_memcpy_once(pool, scratch, nbytes))
            for placement, (src, dst) in placements.items():
                msg = f"{dtype}-{tokens}-{placement}-{rep}".encode()
                pd_s[placement].append(await _pd_once(agent, info.agent_name, conn, src, dst, msg))
        raw_gbps = _gbps(nbytes, raw_s[1:])
        for placement, (src, dst) in placements.items():
            pd = _gbps(nbytes, pd_s[placement][1:])
            results.append(
                {
                    "dtype": dtype,
                    "tokens": tokens,
                    "pages": n,
                    "bytes": nbytes,
                    "placement": placement,
                    "descriptors": len(coalesce(src, dst)) * NUM_LAYERS * 2,
                    "write_pages_gbps": round(pd, 3),
                    "write_pages_ms": round(statistics.median(pd_s[placement][1:]) * 1e3, 3),
                    "raw_nixl_gbps": round(raw_gbps, 3),
                    "memcpy_gbps": round(_gbps(nbytes, memcpy_s[1:]), 3),
                    "write_pages_vs_raw": round(pd / raw_gbps, 3),
                }
            )
    conn.send(("done",))
    agent.close()
    return results


def _print_table(results: list[dict]) -> None:
    header = (
        f"{'dtype':<9}{'tokens':>7}{'MB':>8} {'placement':<11}{'descs':>7}"
        f"{'write_pages':>13}{'ms':>8}{'raw NIXL':>10}{'memcpy':>9}{'pd/raw':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['dtype']:<9}{r['tokens']:>7}{r['bytes'] / 1e6:>8.1f} "
            f"{r['placement']:<11}{r['descriptors']:>7}"
            f"{r['write_pages_gbps']:>13.2f}{r['write_pages_ms']:>8.2f}{r['raw_nixl_gbps']:>10.2f}"
            f"{r['memcpy_gbps']:>9.2f}{r['write_pages_vs_raw']:>8.2f}"
        )
    print("(GB/s = 1e9 bytes/s, median of the repetitions; descs = NIXL descriptors per write)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1000, 4000], help="prompt lengths")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=7, help="repetitions per measurement (median reported)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if max(args.tokens) > NUM_PAGES * PAGE_SIZE:
        parser.error(f"--tokens at most {NUM_PAGES * PAGE_SIZE}")
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    decode = ctx.Process(target=_decode_main, args=(child_conn,), daemon=True)
    decode.start()
    child_conn.close()
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    try:
        results = [
            r
            for dtype in args.dtypes
            for r in asyncio.run(_bench_dtype(dtype, args.tokens, args.reps, conn, rng))
        ]
    finally:
        conn.send(("exit",))
        decode.join(30)
    _print_table(results)
    summary = {
        "benchmark": "kv_transfer",
        "model_geometry": {"num_layers": NUM_LAYERS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM},
        "page_size": PAGE_SIZE,
        "reps": args.reps,
        "wall_s": round(time.perf_counter() - started, 1),
        "results": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
