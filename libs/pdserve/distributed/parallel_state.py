"""The process groups of one tensor-parallel scheduler (SGLang's and vLLM's ``parallel_state.py``).

Tensor parallelism as in Megatron-LM (Shoeybi et al. 2019): every rank holds a slice of each weight
matrix and the ranks combine activations with collectives inside the layers. A ``TpGroup`` holds two
process groups over the same ranks:

- ``device_group`` (NCCL on CUDA, gloo on CPU): the layers' all-reduce and all-gather, and the
  broadcast of the ids rank 0 sampled; called from the forward thread only.
- ``cpu_group`` (always gloo): the scheduler's control messages (pickled objects) and start-up
  agreements; called from the scheduler loop's thread only.

Two groups, so the two threads never interleave collectives on one group. Every collective has
the group's timeout: a rank that died makes its peers' next collective fail at once (the
connection closes), one that hangs makes it fail after ``timeout_s`` seconds, never a silent hang.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TpGroup:
    """One rank's view of its scheduler's TP group; with ``size == 1`` every collective is the identity.

    Attributes:
        rank: this process's rank in ``[0, size)``; rank 0 serves gRPC and emits outputs.
        size: number of ranks (the TP size).
        device_group / cpu_group: the process groups (None for a single rank).
    """

    rank: int = 0
    size: int = 1
    device_group: Any = None
    cpu_group: Any = None

    @property
    def is_driver(self) -> bool:
        """Rank 0: receives requests, samples, emits."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (any shape; float32, bfloat16 or float16)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` (same shape on all) concatenated along ``dim`` in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype on all), in place."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.device_group)
        return x

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (over the gloo ``cpu_group``)."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def min_int(self, value: int) -> int:
        """The smallest ``value`` of all ranks (what every rank can afford, e.g. a KV page count)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


SINGLE_RANK = TpGroup()


RENDEZVOUS_TIMEOUT_S = 600.0  # ranks start (import torch, spawn) at their own pace


def rendezvous_store(host: str = "127.0.0.1") -> dist.TCPStore:
    """The TP group's rendezvous store, listening on ``host`` at a port the kernel picks (``.port``).

    Whoever starts the ranks creates it before they start and keeps it until they joined, so its
    port is held from the moment it is chosen: a port picked free and closed for a rank to bind
    later can be handed out as an ephemeral port in the meantime.
    """
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)


def init_tp_group(rank: int, size: int, address: str, device: torch.device, timeout_s: float) -> TpGroup:
    """Join the TP group rendezvousing at ``address`` ("host:port" of a ``rendezvous_store``, which
    every rank joins as a client); returns at once for ``size == 1``. Ranks may arrive up to
    ``RENDEZVOUS_TIMEOUT_S`` apart; afterwards every collective times out after ``timeout_s``.

    Gloo talks over the interface of ``address``'s host: loopback when it is 127.0.0.1, so ranks
    of one machine or one pod need no network name resolution (``GLOO_SOCKET_IFNAME`` overrides).

    Raises:
        RuntimeError / ValueError: from ``torch.distributed`` when the rendezvous fails or times out.
    """
    if size == 1:
        return SINGLE_RANK
    if address.startswith("127.") and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(
        host, int(port), size, is_master=False, timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    )
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    logger.info("TP rank %d of %d joined (%s device group, gloo control group)", rank, size, backend)
    return TpGroup(rank, size, dist.group.WORLD, cpu_group)


def destroy_tp_groups() -> None:
    """Destroy this process's TP process groups (if any) and free them now, while the interpreter is
    fully alive; call it once the rank is done, after dropping its model (``ModelRunner``).

    A gloo process group that is still referenced when the interpreter finalizes (here: by a dropped
    ``ModelRunner`` left in a reference cycle, which only a full collection frees) is destroyed inside
    ``Py_Finalize``, and its worker threads then abort the process ("terminate called without an
    active exception", SIGABRT, or SIGSEGV): measured on about 1 exit in 5 of a CPU TP rank. So the
    groups are destroyed and the cycles collected here; the caller's own ``TpGroup`` goes with its frame.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
