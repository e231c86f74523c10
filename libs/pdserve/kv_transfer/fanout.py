"""One rank's KV transfers of one request: into each decode rank it writes heads of (``head_map``).

Equal TP sizes give one transfer of whole pages (prefill rank ``i`` into decode rank ``i``); a prefill
rank of a smaller group writes slices of its heads into several decode ranks, one of a larger group a
slice into one, and a rank whose replicated heads another rank writes, none. The fan-out takes the
same calls as one ``KVTransfer`` and passes each to every transfer, with the same pages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from pdserve.kv_transfer.transfer import KVTransfer


class KVFanout:
    """This rank's transfers of one request (see the module docstring).

    Args:
        transfers: one per receiving agent, all with the same transfer id and destination pages.
        num_full, num_local: the destinations in the receivers' pools and local layers' pools.
    """

    def __init__(self, transfers: Sequence[KVTransfer], num_full: int, num_local: int) -> None:
        self.transfers = list(transfers)
        self.num_full = num_full
        self.num_local = num_local

    def send(self, src_pages: Sequence[int], first: int) -> None:
        """``KVTransfer.send`` on every transfer."""
        for transfer in self.transfers:
            transfer.send(src_pages, first)

    def send_local(self, src_pages: Sequence[int]) -> None:
        """``KVTransfer.send_local`` on every transfer."""
        for transfer in self.transfers:
            transfer.send_local(src_pages)

    def finish(self) -> None:
        for transfer in self.transfers:
            transfer.finish()

    async def wait(self, timeout_s: float) -> int:
        """Bytes written by every transfer, once all are done.

        Raises:
            KVTransferError / KVTransferTimeout: the first transfer that failed (the others are then
                cancelled).
        """
        if len(self.transfers) == 1:
            return await self.transfers[0].wait(timeout_s)
        waits = [asyncio.ensure_future(t.wait(timeout_s)) for t in self.transfers]
        try:
            if waits:
                await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            if not all(w.done() and not w.cancelled() and w.exception() is None for w in waits):
                self.cancel()  # each wait then ends once its WRITEs in flight settle
            results = await asyncio.gather(*waits, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return sum(results)

    def fail(self, error: BaseException) -> None:
        for transfer in self.transfers:
            transfer.fail(error)

    def cancel(self) -> None:
        """``KVTransfer.cancel`` on every transfer (idempotent)."""
        for transfer in self.transfers:
            transfer.cancel()
