"""The rank processes of a tensor-parallel scheduler, and how the group fails as one.

``pdserve prefill|decode --tp-size N`` is rank 0: it serves gRPC and starts ranks 1..N-1 as child
processes (multiprocessing ``spawn``: fresh interpreters, no CUDA or OpenMP state inherited), which
join its torch.distributed group over loopback, load their shards and run the same scheduler loop
without a gRPC server. On CPU each rank takes an equal share of the cores (torch threads); on CUDA
rank ``i`` takes GPU ``i`` of those visible (the launcher gives the process N GPUs).

A group that cannot run in step any more goes down as a whole, so that it restarts as a whole:

- a rank dies: rank 0 sees its process end (checked every ``POLL_S``);
- a rank hangs: every rank's event loop stamps a heartbeat into shared memory every ``POLL_S / 2``
  (forwards and collectives run on other threads, so a live rank always beats); one whose beat is
  ``--tp-watchdog`` seconds old is hung (stopped, or its loop blocked);
- a collective fails (a peer's connection closed, or ``COLLECTIVE_TIMEOUT_S`` passed) or a forward
  raises: the rank's loop raises ``TpGroupFailure``;
- rank 0 dies: the kernel kills its children (``PR_SET_PDEATHSIG``).

Rank 0 then ends every request with an error, delivers those outputs, and exits with status 1:
the launcher (or Kubernetes) restarts it, and the group with it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import uvloop

from pdserve.cli_args import setup_service
from pdserve.distributed import SINGLE_RANK, TpGroup, init_tp_group, rendezvous_store
from pdserve.parent_death import die_with_parent
from pdserve.rpc import tls
from pdserve.services.common.bootstrap import rank_device
from pdserve.services.common.scheduler_loop import SchedulerLoop

logger = logging.getLogger(__name__)

BuildServicer = Callable[[argparse.Namespace, str, TpGroup], Awaitable[Any]]
POLL_S = 0.2
COLLECTIVE_TIMEOUT_S = 60.0  # the safety net; deaths and hangs are noticed sooner (above)


def rank_threads(tp_size: int) -> int:
    """Torch threads of one rank on CPU: the cores this process may use, shared equally."""
    return max(1, len(os.sched_getaffinity(0)) // tp_size)


async def join_group(args: argparse.Namespace, rank: int, address: str) -> TpGroup:
    """This rank's ``TpGroup`` (rendezvous on a thread: rank 0 waits there for its children)."""
    if args.tp_size == 1:
        return SINGLE_RANK
    device = torch.device(rank_device(args.device, TpGroup(rank, args.tp_size)))
    if device.type == "cpu":
        torch.set_num_threads(rank_threads(args.tp_size))
    with ThreadPoolExecutor(1, thread_name_prefix="tp-join") as pool:
        return await asyncio.get_running_loop().run_in_executor(
            pool, init_tp_group, rank, args.tp_size, address, device, COLLECTIVE_TIMEOUT_S
        )


class TpRanks:
    """Ranks 1..N-1 of this scheduler, started by rank 0.

    Args:
        args: the scheduler's flags (the children parse nothing).
        service: ``prefill`` or ``decode`` (names the processes and their logs).
        build_servicer: the role's ``SchedulerRole.build_servicer``, which each rank runs.
        address: the service's advertised gRPC address (names the ranks' NIXL agents).

    Attributes:
        address: "127.0.0.1:port" where the group rendezvouses (rank 0 listens).
        failure: why the group went down, once it did.
    """

    def __init__(
        self, args: argparse.Namespace, service: str, build_servicer: BuildServicer, address: str
    ) -> None:
        ctx = mp.get_context("spawn")
        self.store = rendezvous_store()  # held for the process's life, so the port stays ours
        self.address = f"127.0.0.1:{self.store.port}"
        self.size = args.tp_size
        self.beats = ctx.Array("d", self.size, lock=False)  # each rank's last heartbeat (monotonic s)
        self.failure: str | None = None
        self.procs = [
            ctx.Process(
                target=rank_main,
                args=(
                    args,
                    service,
                    build_servicer,
                    rank,
                    self.address,
                    address,
                    self.beats,
                    os.getpid(),
                    tls.identity(),
                ),
                name=f"{service}-tp{rank}",
            )
            for rank in range(1, self.size)
        ]
        for proc in self.procs:
            proc.start()
        logger.info("started TP ranks 1..%d (pids %s)", self.size - 1, [p.pid for p in self.procs])

    async def watch(self, on_failure: Callable[[], None], watchdog_s: float) -> None:
        """Until a rank dies or hangs: then set ``failure`` and call ``on_failure``."""
        started = time.monotonic()
        while self.failure is None:
            await asyncio.sleep(POLL_S)
            now = time.monotonic()
            for rank, proc in enumerate(self.procs, start=1):
                silent = now - max(self.beats[rank], started)
                if not proc.is_alive():
                    self.failure = f"TP rank {rank} exited with code {proc.exitcode}"
                elif silent > watchdog_s:
                    self.failure = f"TP rank {rank} hung: no heartbeat for {silent:.1f} s"
                else:
                    continue
                logger.error("%s: the TP group goes down", self.failure)
                on_failure()
                return

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for ranks that follow rank 0's stop; kill the rest."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()


async def supervise(
    loop: SchedulerLoop,
    stop: asyncio.Event,
    ranks: TpRanks | None,
    watchdog_s: float,
    fail_all: Callable[[str], Awaitable[None] | None],
) -> None:
    """Run ``loop`` until ``stop`` (then return once it ended). If the TP group breaks, end every
    request with an error (``fail_all``) and exit the process with status 1 at once: a thread may be
    stuck in a collective that will never complete."""
    task = asyncio.create_task(loop.run(stop))
    watch = asyncio.create_task(ranks.watch(task.cancel, watchdog_s)) if ranks else None
    try:
        await task
        return
    except asyncio.CancelledError:
        if ranks is None or ranks.failure is None:
            raise
        reason = ranks.failure
    except Exception as e:  # TpGroupFailure, or a bug: a loop that stopped serves nothing
        logger.exception("scheduler loop failed")
        reason = str(e)
    finally:
        if watch is not None:
            watch.cancel()
    logger.error("scheduler group failed (%s): ending every request", reason)
    try:
        done = fail_all(f"scheduler failed: {reason}")
        if done is not None:
            await asyncio.wait_for(done, 5.0)
    finally:
        logging.shutdown()
        os._exit(1)


def rank_main(
    args: argparse.Namespace,
    service: str,
    build_servicer: BuildServicer,
    rank: int,
    group_address: str,
    address: str,
    beats: Any,
    parent_pid: int,
    identity: tls.TlsIdentity | None,
) -> None:
    """Entry point of rank ``rank`` > 0 (a spawned process): join, build, follow rank 0's loop.
    ``identity`` is rank 0's internal TLS identity: any gRPC channel a rank opens uses it too."""
    die_with_parent(parent_pid)()
    tls.configure(identity)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the launcher signals the process group: rank 0 decides
        signal.signal(sig, signal.SIG_IGN)
    setup_service(args, f"{service}-tp{rank}")  # --log-format, --otlp-traces-endpoint as rank 0
    uvloop.run(_serve_rank(args, build_servicer, rank, group_address, address, beats))


async def _serve_rank(
    args: argparse.Namespace,
    build_servicer: BuildServicer,
    rank: int,
    group_address: str,
    address: str,
    beats: Any,
) -> None:
    tp = await join_group(args, rank, group_address)
    servicer = await build_servicer(args, address, tp)
    loop: SchedulerLoop = servicer.loop

    async def beat() -> None:
        while True:
            beats[rank] = time.monotonic()
            await asyncio.sleep(POLL_S / 2)

    heartbeat = asyncio.create_task(beat())
    try:
        await loop.run(asyncio.Event())  # rank 0's stop ends it
    except Exception:
        logger.exception("TP rank %d failed", rank)
        logging.shutdown()
        os._exit(1)
    heartbeat.cancel()
    if servicer.agent is not None:
        servicer.agent.close()
    logger.info("TP rank %d stopped", rank)
