"""CUDA attention with FlashInfer's paged-KV wrappers (Ye et al. 2025, "FlashInfer").

Each layer's K and V in the page-major pool (``KVPool.kv_pages``) are FlashInfer's ``NHD`` paged
layout, ``[num_pages, page_size, Hkv, D]``, as non-contiguous views (pages ``page_stride`` apart),
which its kernels read through the tensors' strides (FlashInfer >= 0.2). Per batch,
``init_forward_metadata`` turns ``req_to_token`` into the CSR page table (``kv_indptr``,
``kv_indices``, ``kv_last_page_len``) and plans one wrapper: ``BatchDecodeWithPagedKVCacheWrapper``
for DECODE batches, ``BatchPrefillWithPagedKVCacheWrapper``
(causal, queries aligned to the end of each sequence, so cached prefixes just work) for EXTEND and
MIXED batches. Requires page-aligned slots: position ``p`` of a request is offset ``p % page_size``
of page ``req_to_token[p] // page_size``.

Layers that attend differently (``AttentionKind``: a sliding window, soft-capped scores, their own
softmax scale; Gemma 3 interleaves two kinds) each get their own wrappers, planned once per batch
with FlashInfer's ``window_left`` (keys ``[i - window_left, i]``: a window of ``W`` keys is
``W - 1``), ``logits_soft_cap`` and ``sm_scale``; a layer runs its kind's. Attention sinks
(gpt-oss) are refused at start: run those models on ``torch_native``.

CUDA graphs (``CudaGraphRunner``): one decode wrapper per captured batch size and kind, in
FlashInfer's ``use_cuda_graph`` mode, whose page-table buffers stay at fixed addresses. Before each
replay the real rows' page table is planned into them and the padded rows get one page each, the
pool's padding page, with one token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from pdserve.layers.attention.base import AttentionBackend
from pdserve.layers.radix_attention import RadixAttention

if TYPE_CHECKING:
    from pdserve.engine.forward_batch import ForwardBatch

_WORKSPACE_BYTES = 128 * 1024 * 1024


class AttentionKind(NamedTuple):
    """What a layer's plan depends on: its window (0: full), score soft-cap (0: none) and scale."""

    sliding_window: int
    logit_cap: float
    scaling: float

    @classmethod
    def of(cls, layer: RadixAttention) -> AttentionKind:
        return cls(layer.sliding_window, layer.logit_cap, layer.scaling)

    def plan_args(self) -> dict[str, Any]:
        window_left = self.sliding_window - 1 if self.sliding_window else -1
        return dict(window_left=window_left, logits_soft_cap=self.logit_cap or None, sm_scale=self.scaling)


class FlashInferAttnBackend(AttentionBackend):
    """Paged attention on CUDA through FlashInfer (imported here, so only when chosen).

    Raises:
        NotImplementedError: a layer of the model has attention sinks.
    """

    supports_cuda_graph = True

    def __init__(self, runner: Any):
        import flashinfer

        from pdserve.engine.forward_batch import ForwardMode

        cfg = runner.model_config
        layers = [m for m in runner.model.modules() if isinstance(m, RadixAttention)]
        if any(layer.sinks is not None for layer in layers):
            raise NotImplementedError(
                "attention sinks (gpt-oss) are not supported by the flashinfer backend: "
                "use --attention-backend torch_native"
            )
        self.kinds = sorted({AttentionKind.of(layer) for layer in layers})
        self.num_heads, self.num_kv_heads = cfg.num_local_heads, cfg.num_local_kv_heads
        self.head_dim = cfg.head_dim
        self.dtype = cfg.dtype
        self.page_size = runner.kv_pool.page_size
        self.decode_mode = ForwardMode.DECODE
        self.flashinfer = flashinfer
        self.device = runner.device
        self.context_pages = -(-cfg.context_length // self.page_size)
        self.use_tensor_cores = self.num_heads // self.num_kv_heads >= 4
        self.workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=runner.device)
        self.decode_wrappers = {
            kind: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
            )
            for kind in self.kinds
        }
        self.prefill_wrappers = {
            kind: flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD") for kind in self.kinds
        }
        self.wrappers = dict(self.decode_wrappers)  # each kind's wrapper planned for this batch
        self.graph_wrappers: dict[tuple[int, AttentionKind], Any] = {}
        self.pad_page = -1

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        kv_indptr, kv_indices, last_page_len = self._page_table(fb)
        if fb.forward_mode is self.decode_mode:
            for kind, wrapper in self.decode_wrappers.items():
                self._plan_decode(wrapper, kind, kv_indptr, kv_indices, last_page_len)
            self.wrappers = dict(self.decode_wrappers)
        else:
            qo_indptr = torch.nn.functional.pad(torch.cumsum(fb.extend_seq_lens, 0), (1, 0)).to(torch.int32)
            for kind, wrapper in self.prefill_wrappers.items():
                wrapper.plan(
                    qo_indptr, kv_indptr, kv_indices, last_page_len, *self._heads(), causal=True,
                    **self._dtypes(), **kind.plan_args(),
                )  # fmt: skip
            self.wrappers = dict(self.prefill_wrappers)

    # ---- CUDA graphs (decode) ------------------------------------------------------------------
    def init_cuda_graph_state(self, batch_sizes: list[int], pad_page: int) -> None:
        """Fixed-address page-table buffers and one graph-mode decode wrapper per batch size and
        attention kind; padded rows read page ``pad_page`` (which no request owns)."""
        max_bs = max(batch_sizes)
        self.pad_page = pad_page
        indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        indices = torch.zeros(max_bs * self.context_pages, dtype=torch.int32, device=self.device)
        last_page_len = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        self.graph_wrappers = {
            (bs, kind): self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=indptr[: bs + 1],
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last_page_len[:bs],
            )
            for bs in batch_sizes
            for kind in self.kinds
        }

    def init_forward_metadata_capture_cuda_graph(self, bs: int) -> None:
        """Plan ``bs`` padded rows and route the layers to that batch size's graph wrappers."""
        self.init_forward_metadata_replay_cuda_graph(bs, None)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, forward_batch: ForwardBatch | None) -> None:
        """Plan the graph wrappers of batch size ``bs`` for the real rows of ``forward_batch`` (a
        DECODE batch of at most ``bs`` requests; None: no real rows) followed by padded rows."""
        if forward_batch is None:
            kv_indptr = torch.zeros(1, dtype=torch.int32, device=self.device)
            kv_indices = last_page_len = kv_indptr[:0]
        else:
            kv_indptr, kv_indices, last_page_len = self._page_table(forward_batch)
        num_pad = bs - last_page_len.shape[0]
        ones = torch.ones(num_pad, dtype=torch.int32, device=self.device)
        indptr = torch.cat([kv_indptr, kv_indptr[-1] + ones.cumsum(0, dtype=torch.int32)])
        indices = torch.cat([kv_indices, ones * self.pad_page])
        last = torch.cat([last_page_len, ones])
        self.wrappers = {kind: self.graph_wrappers[bs, kind] for kind in self.kinds}
        for kind, wrapper in self.wrappers.items():
            self._plan_decode(wrapper, kind, indptr, indices, last)

    # ---- helpers -------------------------------------------------------------------------------
    def _page_table(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FlashInfer's CSR page table of the batch: int32 ``kv_indptr`` ``[B + 1]``,
        ``kv_indices`` (page ids, request by request) and ``kv_last_page_len`` ``[B]``."""
        ps = self.page_size
        num_pages = (fb.seq_lens + ps - 1) // ps
        max_pages = int(num_pages.max())
        first_slots = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, : max_pages * ps : ps]
        in_use = torch.arange(max_pages, device=first_slots.device)[None, :] < num_pages[:, None]
        kv_indices = (first_slots // ps)[in_use].to(torch.int32)
        kv_indptr = torch.nn.functional.pad(torch.cumsum(num_pages, 0), (1, 0)).to(torch.int32)
        last_page_len = ((fb.seq_lens - 1) % ps + 1).to(torch.int32)
        return kv_indptr, kv_indices, last_page_len

    def _plan_decode(self, wrapper: Any, kind: AttentionKind, kv_indptr, kv_indices, last_page_len) -> None:
        wrapper.plan(
            kv_indptr, kv_indices, last_page_len, *self._heads(), **self._dtypes(), **kind.plan_args()
        )

    def _heads(self) -> tuple[int, int, int, int]:
        return self.num_heads, self.num_kv_heads, self.head_dim, self.page_size

    def _dtypes(self) -> dict[str, Any]:
        return dict(q_data_type=self.dtype, kv_data_type=self.dtype)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        k_pages, v_pages = self.store_kv(k, v, layer, forward_batch)
        num_tokens = q.shape[0]
        wrapper = self.wrappers[AttentionKind.of(layer)]
        out = wrapper.run(q.view(num_tokens, self.num_heads, self.head_dim), (k_pages, v_pages))
        return out.view(num_tokens, self.num_heads * self.head_dim)
