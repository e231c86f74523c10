"""KV transfer between schedulers over NIXL: agents, registration, page WRITEs, notifications.

The prefill scheduler WRITEs a request's KV pages into the decode scheduler's pages (decode-driven PD
handshake, see docs/design.md); both exchange ``KVAgentInfo`` once per peer over gRPC.

Design (chosen by ``make bench-kv``; numbers below). The pool is page-major,
``[page, layer, k/v, slot, head, dim]`` (``KVPool``): one page of every layer is one contiguous byte
range, so a run of pages consecutive on both sides is ONE NIXL descriptor whatever the number of
layers, and a fully scattered 1,000-token prompt is 63 descriptors (16-token pages) instead of 3,780
with the layer-major pool. Each layer's K (V) is a strided view ``[num_pages, page_size, Hkv, D]``
whose pages lie ``page_stride`` apart; the attention kernels (ours on CPU, FlashInfer's on CUDA) and
the KV store read and write it in place through that stride, with no copy in the forward. A
descriptor costs about what 20 KB of the wire does (UCX moves a CPU host's puts with CMA, one
``process_vm_writev`` each), and a page of SmolLM2 is 368-737 KB, so placement no longer matters.

The allocator keeps placements run-friendly (best fit over free runs: ``PagedTokenToKVPoolAllocator``).
A chunked prefill sends each chunk's finished pages while the next chunk computes; the receiver
completes a transfer only once every page landed (each counted once, only from the expected sender,
only while the transfer is expected), so decode never reads a page before its last byte has
arrived. A transfer that fails or is cancelled settles only once no WRITE of it is in flight, and
the decode side holds the pages of a request that ends while they arrive until the prefill worker's
call has ended (``RemotePrefill.draining``), so a late WRITE never lands in pages another request
owns.

Measured on the 2-core AMD EPYC Zen 5 (AVX512-BF16; quiet), SmolLM2 geometry, time until the decode
side has every page, as a ratio to a raw one-buffer NIXL WRITE in the same run (min-max of three runs
of 31 repetitions each; the layer-major design measured in the same session with the benchmark of its
commit, whose decode side awaited the pages without the sender's "written" message):

=================  =======================  =======================  =====================
placement           page-major (now)         layer-major, direct      layer-major, staged
=================  =======================  =======================  =====================
1,000 tokens fp32  descriptors / x raw       descriptors / x raw      descriptors / x raw
contiguous         1 / 0.90-0.97             60 / 0.82-0.99           60 / 0.82-0.94
scattered          63 / 0.92-1.03            3,780 / 0.38-0.47        13 / 0.49-0.63
after churn        5 / 0.95-1.07             300 / 0.77-0.91          300 / 0.78-0.92
1,000 tokens bf16
contiguous         1 / 0.84-0.95             60 / 0.73-0.87           60 / 0.73-0.80
scattered          63 / 0.84-0.87            3,780 / 0.26-0.28        6 / 0.42-0.44
after churn        3 / 0.90-0.92             180 / 0.71-0.80          180 / 0.68-0.71
4,000 tokens fp32
scattered          250 / 0.97-1.04           15,000 / 0.46-0.62       50 / 0.54-0.72
after churn        11 / 1.03-1.07            660 / 0.99-1.21          660 / 0.95-1.28
4,000 tokens bf16
scattered          250 / 0.94-1.02           15,000 / 0.30-0.32       23 / 0.43-0.50
after churn        10 / 0.96-1.05            600 / 0.90-0.94          600 / 0.88-0.92
=================  =======================  =======================  =====================

Prefill and decode of different TP sizes pair their ranks by KV heads (``head_map``) and move each
pair's heads as a head slice of every page: one descriptor per ``(page, layer, kv, slot)`` row
(``descriptors.head_slice_descs``), many more than whole pages need (docs/design.md, "Prefill and
decode of different TP sizes"); equal sizes keep whole pages.

The staging design (gather into registered slots, one descriptor per slot, scatter on the decode
side) kept the descriptor count flat but added two copies to the wire's one, and stayed under 0.72x
for scattered pages; it is gone with the page-major pool. What remains of the gap to raw is a fixed
cost per transfer (thread hand-offs, notification polling: ~0.5 ms), visible only for small prompts.
"""

from pdserve.kv_transfer.agent import KVTransferAgent
from pdserve.kv_transfer.descriptors import coalesce
from pdserve.kv_transfer.errors import KVLayoutMismatch, KVTransferError, KVTransferTimeout
from pdserve.kv_transfer.fanout import KVFanout
from pdserve.kv_transfer.head_map import HeadRoute, HeadSlice, head_map
from pdserve.kv_transfer.layout import POOL_LAYOUT, KVAgentInfo, KVLayout, check_compatible
from pdserve.kv_transfer.receiver import KVReceive
from pdserve.kv_transfer.transfer import KVTransfer

__all__ = [
    "POOL_LAYOUT",
    "HeadRoute",
    "HeadSlice",
    "KVAgentInfo",
    "KVFanout",
    "KVLayout",
    "KVLayoutMismatch",
    "KVReceive",
    "KVTransfer",
    "KVTransferAgent",
    "KVTransferError",
    "KVTransferTimeout",
    "check_compatible",
    "coalesce",
    "head_map",
]
