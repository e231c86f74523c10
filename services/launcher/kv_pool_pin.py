"""A restarted scheduler gets the KV pool of its first start.

Without ``--max-total-tokens`` or ``--kv-cache-memory`` a scheduler sizes its KV pool from the memory
free when it starts, so one restarted on a busy host came back smaller (1,972 -> 782 pages). Once a
scheduler is first ready the launcher reads its pool (``GetLoad``: ``kv_pages_total * page_size``
tokens) and restarts it with ``--max-total-tokens`` of that size from then on. Where that memory is
not there any more the restart fails with a clear message (``ModelRunner``) and is retried with
backoff, rather than serving with a smaller pool.
"""

from __future__ import annotations

import logging

import grpc

from pdserve.rpc import tls
from pdserve.rpc.server import GRPC_OPTIONS
from pdserve.services.common.supervision.spec import ServiceSpec
from pdserve.services.launcher import convert

logger = logging.getLogger("pdserve.launch")

_SIZING_FLAGS = ("--kv-memory-fraction", "--max-total-tokens", "--kv-cache-memory")


async def read_kv_pool_tokens(role: str, address: str, timeout: float = 10.0) -> int:
    """Tokens of the KV pool of the ``role`` ("prefill" or "decode") scheduler at ``address``.

    Raises:
        grpc.aio.AioRpcError: ``GetLoad`` failed.
    """
    async with tls.internal_channel(address, GRPC_OPTIONS) as channel:
        info = await convert.scheduler_stub(role, channel).GetLoad(convert.load_request(), timeout=timeout)
    return convert.kv_pool_tokens(info)


async def pin_first_pool(spec: ServiceSpec) -> None:
    """The ``Supervisor``'s ``on_ready``: once a scheduler sized from free memory is ready, its
    restarts get the pool it has now (``spec.argv`` pinned, ``spec.pin_kv_pool`` cleared); a pool
    that cannot be read is logged and left to be sized anew."""
    if not spec.pin_kv_pool:
        return
    try:
        tokens = await read_kv_pool_tokens(spec.role, spec.health)
    except grpc.aio.AioRpcError as e:
        logger.warning("cannot read the KV pool size of %s (%s): a restart sizes it anew", spec.name, e)
        return
    spec.argv = pin_kv_pool(spec.argv, tokens)
    spec.pin_kv_pool = False
    logger.info("%s has a KV pool of %d tokens; a restart gets the same", spec.name, tokens)


def pin_kv_pool(argv: list[str], tokens: int) -> list[str]:
    """``argv`` with its pool-sizing flags (each followed by its value) replaced by
    ``--max-total-tokens tokens``."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _SIZING_FLAGS:
            skip = True
        else:
            out.append(arg)
    return [*out, "--max-total-tokens", str(tokens)]
