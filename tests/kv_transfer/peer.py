"""A decode-role KV agent in a child process (multiprocessing spawn), driven over a Pipe by tests."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from pdserve.kv_transfer import (
    KVAgentInfo,
    KVLayout,
    KVReceive,
    KVTransferAgent,
    KVTransferError,
)

LAYOUT = KVLayout(
    model="test-model", dtype="float32", page_size=16, num_layers=4, num_kv_heads=3, head_dim=64
)
NUM_PAGES = 64


def pool_shape(layout: KVLayout, num_pages: int) -> tuple[int, ...]:
    """``kv_data`` shape ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]``."""
    return (num_pages, layout.num_layers, 2, layout.page_size, layout.num_kv_heads, layout.head_dim)


def seeded_pool(layout: KVLayout, num_pages: int, seed: int) -> torch.Tensor:
    """A pool filled with N(0, 1) from ``seed``: the same tensor in every process."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(pool_shape(layout, num_pages), generator=gen).to(getattr(torch, layout.dtype))


def _serve(conn: Connection, name: str, seed: int) -> None:
    torch.set_num_threads(1)
    kv_data = seeded_pool(LAYOUT, NUM_PAGES, seed)
    agent = KVTransferAgent(name, kv_data, LAYOUT)
    conn.send(agent.local_info())
    receives: dict[bytes, KVReceive] = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "add_peer":  # (info,): a sender
            agent.add_peer(args[0])
            conn.send("ok")
        elif cmd == "expect":  # (peer, tid, dst_pages)
            receives[args[1]] = agent.expect(*args)
            conn.send("ok")
        elif cmd == "wait":  # (tid, timeout_s) -> bytes received, or the error text
            try:
                conn.send(asyncio.run(receives.pop(args[0]).wait(args[1])))
            except KVTransferError as e:
                conn.send(f"{type(e).__name__}: {e}")
        elif cmd == "done":
            conn.send(receives[args[0]].done)
        elif cmd == "cancel":
            receives[args[0]].cancel()
            conn.send("ok")
        elif cmd == "dump":
            conn.send(kv_data.clone())
        elif cmd == "exit":
            agent.close()
            conn.send("bye")
            return


@dataclass
class Peer:
    """Handle on the child: its process, pipe and ``KVAgentInfo``."""

    process: mp.Process
    conn: Connection
    info: KVAgentInfo

    def ask(self, *cmd: object) -> object:
        self.conn.send(cmd)
        return self.conn.recv()

    def pool(self) -> torch.Tensor:
        return self.ask("dump")

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.process.pid, sig)

    def stop(self) -> None:
        if self.process.is_alive():
            self.signal(signal.SIGCONT)
            self.conn.send(("exit",))
            if self.conn.poll(10):
                self.conn.recv()
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def start_peer(name: str, seed: int) -> Peer:
    """Spawn a child holding a ``KVTransferAgent`` over ``seeded_pool(LAYOUT, NUM_PAGES, seed)``."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_serve, args=(child, name, seed), daemon=True)
    process.start()
    child.close()  # so a child that dies during start-up reads as EOF here
    if not parent.poll(60):
        process.kill()
        raise RuntimeError("KV peer process did not start within 60 s")
    return Peer(process, parent, parent.recv())
