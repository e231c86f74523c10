"""The attention backend interface every kernel family implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from pdserve.layers.cpu_fused_ops import load_fused_ops

if TYPE_CHECKING:
    from pdserve.engine.forward_batch import ForwardBatch
    from pdserve.layers.radix_attention import RadixAttention


class AttentionBackend(ABC):
    """Paged attention over the KV pool for a batch mixing extends (with cached prefixes) and decodes.

    Invariants: ``init_forward_metadata`` runs once per forward, before any layer, and derives
    everything that is the same for all layers (index maps, masks, kernel plans); ``forward`` runs
    once per layer and first stores the new k/v at ``forward_batch.out_cache_loc``, so each token
    attends to its own key. Request ``b``'s query at position ``p`` attends to its keys at
    positions ``[0, p]``, read through ``req_to_token[req_pool_indices[b]]``.

    Subclasses set ``num_heads``, ``num_kv_heads`` (this TP rank's: ``num_local_heads`` /
    ``num_local_kv_heads`` of the model config) and ``head_dim`` from the model config. One
    that sets ``supports_cuda_graph`` implements the three ``cuda_graph`` methods, which let
    ``CudaGraphRunner`` capture and replay DECODE forwards of padded batch sizes.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    supports_cuda_graph = False

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Prepare the per-batch metadata."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """``q`` ``[T, Hq * D]``, ``k``/``v`` ``[T, Hkv * D]`` → output ``[T, Hq * D]`` in q's dtype."""

    def init_cuda_graph_state(self, batch_sizes: list[int], pad_page: int) -> None:
        """Allocate what graphs of these batch sizes read at fixed addresses; padded rows use the
        pool page ``pad_page``, which no request owns."""
        raise NotImplementedError(f"{type(self).__name__} does not capture CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(self, bs: int) -> None:
        """Prepare a forward of ``bs`` padded rows, about to be captured."""
        raise NotImplementedError(f"{type(self).__name__} does not capture CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(self, bs: int, forward_batch: ForwardBatch) -> None:
        """Prepare the replay of the ``bs`` graph for ``forward_batch`` (at most ``bs`` decodes)."""
        raise NotImplementedError(f"{type(self).__name__} does not capture CUDA graphs")

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's ``k``/``v`` (``[T, Hkv * D]``) at ``out_cache_loc`` of ``layer``'s pool
        pages; returns that layer's K and V pages, ``[num_pages, page_size, Hkv, D]`` each."""
        pool = forward_batch.token_to_kv_pool
        loc = forward_batch.out_cache_loc
        if forward_batch.swa_out_cache_loc is not None and pool.is_local[layer.layer_id]:
            loc = forward_batch.swa_out_cache_loc  # a sliding-window layer's slots in the local pool
        ops = load_fused_ops()
        if (
            ops is not None
            and ops.supports(k)
            and ops.stores_kv(k, pool.dtype)
            and k.stride(1) == v.stride(1) == 1
        ):
            # one C call, reading k/v in place from the fused qkv output
            ops.store_kv(k, v, *pool.kv_pages(layer.layer_id), loc)
        else:
            num_tokens = k.shape[0]
            pool.set_kv(
                layer.layer_id,
                loc,
                k.view(num_tokens, self.num_kv_heads, self.head_dim),
                v.view(num_tokens, self.num_kv_heads, self.head_dim),
            )
        return pool.kv_pages(layer.layer_id)
