"""CUDA attention with FlashInfer's paged-KV wrappers (Ye et al. 2025, "FlashInfer").

The KV pool layer ``kv_data[layer]`` is already FlashInfer's ``NHD`` paged layout: K and V each
``[num_pages, page_size, Hkv, D]``. Per batch, ``init_forward_metadata`` turns ``req_to_token`` into
the CSR page table (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``) and plans one wrapper:
``BatchDecodeWithPagedKVCacheWrapper`` for DECODE batches, ``BatchPrefillWithPagedKVCacheWrapper``
(causal, queries aligned to the end of each sequence, so cached prefixes just work) for EXTEND and
MIXED batches. Requires page-aligned slots: position ``p`` of a request is offset ``p % page_size``
of page ``req_to_token[p] // page_size``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pdserve.layers.attention.base import AttentionBackend

if TYPE_CHECKING:
    from pdserve.engine.forward_batch import ForwardBatch
    from pdserve.layers.radix_attention import RadixAttention

_WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttnBackend(AttentionBackend):
    """Paged attention on CUDA through FlashInfer (imported here, so only when chosen)."""

    def __init__(self, runner: Any):
        import flashinfer

        from pdserve.engine.forward_batch import ForwardMode

        cfg = runner.model_config
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.dtype = cfg.dtype
        self.page_size = runner.kv_pool.page_size
        self.decode_mode = ForwardMode.DECODE
        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=runner.device)
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=self.num_heads // self.num_kv_heads >= 4
        )
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.wrapper = self.decode_wrapper

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb, ps = forward_batch, self.page_size
        num_pages = (fb.seq_lens + ps - 1) // ps
        max_pages = int(num_pages.max())
        first_slots = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, : max_pages * ps : ps]
        in_use = torch.arange(max_pages, device=first_slots.device)[None, :] < num_pages[:, None]
        kv_indices = (first_slots // ps)[in_use].to(torch.int32)
        kv_indptr = torch.nn.functional.pad(torch.cumsum(num_pages, 0), (1, 0)).to(torch.int32)
        last_page_len = ((fb.seq_lens - 1) % ps + 1).to(torch.int32)
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.head_dim**-0.5)
        heads = (self.num_heads, self.num_kv_heads, self.head_dim, ps)
        if fb.forward_mode is self.decode_mode:
            self.decode_wrapper.plan(kv_indptr, kv_indices, last_page_len, *heads, **common)
            self.wrapper = self.decode_wrapper
        else:
            qo_indptr = torch.nn.functional.pad(torch.cumsum(fb.extend_seq_lens, 0), (1, 0)).to(torch.int32)
            self.prefill_wrapper.plan(
                qo_indptr, kv_indptr, kv_indices, last_page_len, *heads, causal=True, **common
            )
            self.wrapper = self.prefill_wrapper

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
        out = self.wrapper.run(q.view(num_tokens, self.num_heads, self.head_dim), (k_pages, v_pages))
        return out.view(num_tokens, self.num_heads * self.head_dim)
