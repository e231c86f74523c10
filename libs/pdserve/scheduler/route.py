"""``Route``: where a request came from and where its KV and outputs go.

Transport facts the scheduler carries for its servicer and never reads: a decode (or mixed) worker
takes them from the gateway's request, a prefill worker from the decode worker's Prefill call. Under
tensor parallelism they travel with the request to every rank (a rank > 0 opens its own KV transfer
from them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Route:
    """A request's addresses and KV destination; fields that do not apply to a role stay empty.

    Attributes:
        prefill_address: decode role: the prefill worker the gateway's router picked ("host:port").
        fallback_prefill_addresses: decode role: where a failed prefill is retried, in order.
        output_address: the detokenizer that gets the request's token ids ("" once it is gone).
        gateway_address: the gateway replica that owns the request (its outputs go back there).
        scheduler_address: this worker's advertised address (the detokenizer aborts here on a stop
            string).
        kv_dst_agent: prefill role: the decode worker's NIXL agent that receives the KV.
        kv_dst_pages: prefill role: the decode worker's pages for the prompt's pages from
            ``kv_dst_start_page`` on (the ones it does not hold already).
        kv_dst_start_page: prefill role: the first prompt page the decode worker lacks.
        kv_dst_local_pages: prefill role, with an SWA pool: the decode worker's local-layer pages for
            the prompt's last pages (the ones its first decode step's window reads).
        kv_transfer_id: prefill role: the transfer's id (the decode worker's notifications name it).
    """

    prefill_address: str = ""
    fallback_prefill_addresses: tuple[str, ...] = ()
    output_address: str = ""
    gateway_address: str = ""
    scheduler_address: str = ""
    kv_dst_agent: str = ""
    kv_dst_pages: tuple[int, ...] = ()
    kv_dst_start_page: int = 0
    kv_dst_local_pages: tuple[int, ...] = ()
    kv_transfer_id: bytes = b""

    @property
    def prefill_addresses(self) -> list[str]:
        """The router's prefill worker, then its fallbacks."""
        return [self.prefill_address, *self.fallback_prefill_addresses]
