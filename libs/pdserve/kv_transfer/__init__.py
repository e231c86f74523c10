"""KV transfer between schedulers over NIXL: agents, registration, staged and direct page WRITEs.

The prefill scheduler WRITEs a request's KV pages into the decode scheduler's pages (decode-driven PD
handshake, see ARCHITECTURE.md); both exchange ``KVAgentInfo`` once per peer over gRPC, the decode
side granting the prefill worker a receive lane of its staging memory in it.

Design (chosen by ``make bench-kv``; numbers below). The pool stays ``[layer, k/v, page, ...]``, the
layout the attention kernels read in place. A page is then 2 x layers pieces (60 for SmolLM2), and a
NIXL descriptor costs about what 20 KB of the wire does (UCX puts through CMA on a CPU host), so
writing scattered pages as one descriptor per piece ran at 0.29-0.50x a raw one-buffer WRITE. Pages
now move in one of two ways, per group of pages a ``send`` hands over (``sender.KVSender.plan``):

- direct: runs of pages consecutive on both sides whose descriptors average ``direct_min_bytes``
  (16 KiB) or more go straight into the destination pages, one descriptor per layer, k/v and run;
- staged: any other group is gathered into a registered send slot (a few MiB), written as ONE
  descriptor into a slot of the receiver's lane, scattered there into the destination pages, and the
  slot ACKed back; a gather thread fills the next slot while a post thread writes the previous one,
  and the receiver scatters while the next slot is on the wire. The descriptor count is one per slot
  whatever the placement.

The allocator keeps placements run-friendly (best fit over free runs: ``PagedTokenToKVPoolAllocator``),
so after churn most transfers go direct. A chunked prefill sends each chunk's finished pages while the
next chunk computes; the receiver completes a transfer only once every page landed (each counted once,
only from the expected sender, only while the transfer is expected), so decode never reads a page
before its last byte has arrived, and a cancelled transfer is never written again (staged pages reach
the pool only through the receiver's scatter).

Measured on the 2-core AMD EPYC Zen 3 shared with other jobs (load 7-12), SmolLM2 geometry, time
until the decode side has every page, as a ratio to a raw one-buffer NIXL WRITE in the same run:

=================================  ===========  ==========  ============================
1,000-token prompt                 fp32         bf16        NIXL descriptors
=================================  ===========  ==========  ============================
contiguous, direct                 0.95-1.06x   0.97-1.07x  60
scattered, direct (previous)       0.43-0.50x   0.25-0.33x  3,780
scattered, staged                  0.43-0.57x   0.31-0.32x  13 (fp32) / 6 (bf16)
after churn, best fit, direct      0.82-0.94x   0.63-0.80x  180-360
page-major pool (side prototype)   0.78-0.96x   0.92-1.05x  63
=================================  ===========  ==========  ============================

Why staging stays short of 0.8x here: CMA (``process_vm_writev``) moves ~3 GB/s on this box and a
memcpy ~6 GB/s, so gather + wire + scatter is about twice the wire's CPU work; the threads overlap
it only with a free core, and a loaded 2-core box has none (profile: gather 10 ms, WRITEs 12-19 ms,
scatter 8 ms on the other side, for 46 MB). Tried and dropped: NIXL prepped descriptor lists
(``initialize_xfer`` is 37 us of a 1+ ms slot), NIXL's strided (Nx5) descriptors (its UCX backend
moved only the first block of each), transparent huge pages under the staging slots (no change),
UCX's legacy protocols (no CMA puts). A pool laid out page-major would reach the target with no
copies, but every attention kernel would need a page stride: left for a change agreed with the
kernels' owners.
"""

from pdserve.kv_transfer.agent import KVTransferAgent
from pdserve.kv_transfer.descriptors import coalesce
from pdserve.kv_transfer.errors import KVLayoutMismatch, KVTransferError, KVTransferTimeout
from pdserve.kv_transfer.layout import POOL_LAYOUT, KVAgentInfo, KVLayout, check_compatible
from pdserve.kv_transfer.receiver import KVReceive
from pdserve.kv_transfer.transfer import KVTransfer

__all__ = [
    "POOL_LAYOUT",
    "KVAgentInfo",
    "KVLayout",
    "KVLayoutMismatch",
    "KVReceive",
    "KVTransfer",
    "KVTransferAgent",
    "KVTransferError",
    "KVTransferTimeout",
    "check_compatible",
    "coalesce",
]
