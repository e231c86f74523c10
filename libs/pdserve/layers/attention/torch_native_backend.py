"""Attention in PyTorch ops (any device), with a C kernel on CPU: the CPU backend.

On CPU the C kernel (``cpu_decode_kernel``) reads the KV pages in place and runs every token of the
batch as a row: the token at position ``p`` of request ``b`` attends to keys ``[0, p]`` of its
request, so a row needs only its request's page table and the length ``p + 1`` (its own key is
stored before attention runs). Decoding tokens and the tokens of an extend (a prefill, a chunk,
the rest of a prompt after a radix-cache hit) are computed alike, so a token's attention output is
the same bit for bit however its request is batched, chunked or cached (batch invariance).

A verifying request (speculative decoding: its last token and ``k`` draft tokens, with logits at
each; ``ForwardBatch.logits_lens`` > 1) is an extend like any other here: its token at position
``p`` is a row attending keys ``[0, p]``, so a verify step computes, bit for bit where the matmuls
are per row (our CPU matmuls), what decoding those tokens one at a time computes, and greedy
speculation gives the tokens greedy decoding gives.

A layer passes the kernel its sliding window (Mistral, Gemma 3's local layers, gpt-oss's
alternate layers: the token at position ``p`` attends keys ``(p - window, p]``), its scores'
soft-cap (Gemma 2 style ``attn_logit_softcapping``) and its attention sinks (gpt-oss).

Otherwise (no C kernels, or another device) requests are split into at most two groups, decoding
ones (one query token) and extending ones (a ragged chunk after a cached prefix, verifying requests
among them), so a MIXED batch does not pad its decodes to the longest extend. Each group's KV pages
are gathered into a padded batch and attended with one SDPA per layer: queries padded to ``Lq``
(the longest chunk), keys to ``Lk`` (the longest sequence, in whole pages; position ``p`` of a
request is offset ``p % page_size`` of page ``req_to_token[p] // page_size``), and a boolean mask
keeps, for the query at position ``p``, the keys at positions ``[0, p]`` of its own request
(``(p - window, p]`` in a sliding-window layer: one mask per distinct window, built once per
batch). GQA needs no K/V repeat: the ``G = Hq / Hkv`` query heads sharing a KV head are folded into
the query-length axis, so SDPA sees ``Hkv`` heads of ``G * Lq`` queries; a model with soft-capping
or sinks gets explicit scores (``score_mods``) instead. (SDPA's reductions are not batch-invariant.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pdserve.layers.attention.base import AttentionBackend
from pdserve.layers.attention.cpu_decode_kernel import load_decode_kernel
from pdserve.layers.attention.score_mods import attend_with_score_mods, needs_score_mods
from pdserve.layers.radix_attention import RadixAttention
from pdserve.mem_cache.swa_pool import SWAKVPool

if TYPE_CHECKING:
    from pdserve.engine.forward_batch import ForwardBatch


@dataclass(slots=True)
class _Group:
    """Index maps of ``Bg`` requests attended together (padded to ``Lq`` queries, ``Lk`` keys).

    Attributes:
        query_index: int64 ``[Bg, Lq]``: flat token index of each padded query (padding → 0).
        query_valid: bool ``[Bg, Lq]``, or None when no query is padding (decode).
        out_index: int64 ``[n]``: flat token index of each valid query in row-major order, or None
            when that is simply ``0..T-1`` (the group is the whole batch).
        page_table: int64 ``[Bg, Lk / page_size]``: KV pages of each request, padded with page 0 (masked).
        seq_lens: int64 ``[Bg]``: keys of each request.
        masks: per sliding window of the model's layers (0: full causal), bool ``[Bg, 1, G * Lq,
            Lk]``: True where the query may attend to the key.
        local_page_table: ``page_table`` in the local pool of an ``SWAKVPool`` (its sliding-window
            layers' pages), else None.
    """

    query_index: torch.Tensor
    query_valid: torch.Tensor | None
    out_index: torch.Tensor | None
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    masks: dict[int, torch.Tensor]
    local_page_table: torch.Tensor | None


@dataclass(slots=True)
class _KernelRows:
    """One kernel row per token of the batch, in batch order.

    Attributes:
        page_table: int64 ``[B, max_pages]``: the KV pages of each request.
        seq_lens: int64 ``[T]``: keys each token attends to (its position + 1).
        row_req: int64 ``[T]``: each token's request (row of ``page_table``), or None when every
            request has one token (token ``t`` is request ``t``).
        local_page_table: ``page_table`` in the local pool of an ``SWAKVPool``, else None.
    """

    page_table: torch.Tensor
    seq_lens: torch.Tensor
    row_req: torch.Tensor | None
    local_page_table: torch.Tensor | None

    def table(self, local: bool) -> torch.Tensor:
        return self.local_page_table if local else self.page_table


class TorchNativeAttnBackend(AttentionBackend):
    """Paged attention for any device PyTorch runs on; the CPU backend pdserve tests with.

    Args:
        runner: the ``ModelRunner`` (model config, KV pool, device; its loaded model's attention
            layers, for their sliding windows and score modifications).
        use_cpu_kernels: on CPU, run attention through the C kernel of ``cpu_decode_kernel`` where
            it builds and supports the dtype, instead of gather + SDPA.
    """

    def __init__(self, runner: Any, use_cpu_kernels: bool = True):
        config = runner.model_config
        model = getattr(runner, "model", None)
        layers = [m for m in model.modules() if isinstance(m, RadixAttention)] if model is not None else []
        self.windows = sorted({layer.sliding_window for layer in layers} | {0})
        self.score_mods = any(needs_score_mods(layer) for layer in layers)
        on_cpu = use_cpu_kernels and runner.device.type == "cpu"
        kernel = load_decode_kernel() if on_cpu else None
        kv_dtype = runner.kv_pool.dtype  # the kernel runs in the pool's dtype (queries rounded to it)
        self.decode_kernel = kernel if kernel and kernel.supports(kv_dtype) else None
        self.num_heads = config.num_local_heads
        self.num_kv_heads = config.num_local_kv_heads
        self.head_dim = config.head_dim
        self.page_size = runner.kv_pool.page_size
        self.swa_pool = runner.kv_pool if isinstance(runner.kv_pool, SWAKVPool) else None
        self.groups: list[_Group] = []
        self.kernel_rows: _KernelRows | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        self.groups, self.kernel_rows = [], None
        if self.decode_kernel is not None:
            self.kernel_rows = self._kernel_rows(fb)
            return
        extending = fb.extend_seq_lens > 1
        extend_rows = extending.nonzero().squeeze(1)
        decode_rows = (~extending).nonzero().squeeze(1)
        if len(decode_rows) == 0 or len(extend_rows) == 0:
            self.groups = [self._group(fb, None)]
        else:
            self.groups = [self._group(fb, decode_rows), self._group(fb, extend_rows)]

    def _kernel_rows(self, fb: ForwardBatch) -> _KernelRows:
        """A kernel row per token: its request's pages and its position + 1 keys."""
        page_table = self._page_table(fb, fb.req_pool_indices, fb.seq_lens)
        row_req = None
        if len(fb.positions) != fb.batch_size:
            requests = torch.arange(fb.batch_size, device=fb.positions.device)
            row_req = requests.repeat_interleave(fb.extend_seq_lens).contiguous()
        page_table = page_table.contiguous()
        local = self._local(fb, None, page_table.shape[1])
        return _KernelRows(page_table, (fb.positions + 1).contiguous(), row_req, local)

    @staticmethod
    def _local(fb: ForwardBatch, rows: torch.Tensor | None, max_pages: int) -> torch.Tensor | None:
        """The local pages (an SWA pool's) of requests ``rows`` (all when None), ``max_pages`` wide;
        None without an SWA pool."""
        if fb.swa_page_rows is None:
            return None
        table = fb.swa_page_rows if rows is None else fb.swa_page_rows[rows]
        return table[:, :max_pages].contiguous()

    def _is_local(self, layer: RadixAttention) -> bool:
        return self.swa_pool is not None and self.swa_pool.is_local[layer.layer_id]

    def _page_table(self, fb: ForwardBatch, pool_rows: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """int64 ``[B, max_pages]``: the KV pages of requests ``pool_rows`` (``req_to_token`` rows)
        holding ``seq_lens`` tokens, padded with page 0 (never read: lengths bound every read)."""
        ps = self.page_size
        num_pages = (seq_lens + ps - 1) // ps
        max_pages = int(num_pages.max())
        first_slots = fb.req_to_token_pool.req_to_token[pool_rows, : max_pages * ps : ps]
        page_valid = torch.arange(max_pages, device=first_slots.device)[None, :] < num_pages[:, None]
        return torch.where(page_valid, first_slots // ps, 0)

    def _group(self, fb: ForwardBatch, rows: torch.Tensor | None) -> _Group:
        """Metadata of the requests ``rows`` (all when None)."""
        per_request = (
            fb.extend_seq_lens,
            fb.extend_prefix_lens,
            fb.seq_lens,
            fb.extend_start_loc,
            fb.req_pool_indices,
        )
        if rows is not None:
            per_request = tuple(t[rows] for t in per_request)
        ext, prefix, seq, starts, pool_rows = per_request
        device = ext.device
        page_table = self._page_table(fb, pool_rows, seq)
        max_q, max_k = int(ext.max()), page_table.shape[1] * self.page_size
        q_pos = torch.arange(max_q, device=device)[None, :]
        query_valid = q_pos < ext[:, None]
        query_index = torch.where(query_valid, starts[:, None] + q_pos, 0)
        k_pos = torch.arange(max_k, device=device)[None, None, :]
        q_abs = (prefix[:, None] + q_pos)[:, :, None]
        causal = (k_pos <= q_abs) & (k_pos < seq[:, None, None])  # [Bg, Lq, Lk]
        g = self.num_heads // self.num_kv_heads
        masks = {}
        for window in self.windows:
            # padding queries keep every causal key, so that no row of the softmax is empty
            mask = causal & ((k_pos > q_abs - window) | ~query_valid[:, :, None]) if window else causal
            mask = mask[:, None, None].expand(-1, 1, g, -1, -1)
            masks[window] = mask.reshape(len(ext), 1, g * max_q, max_k)
        return _Group(
            query_index=query_index,
            query_valid=None if max_q == 1 else query_valid,
            out_index=None if rows is None else query_index[query_valid],
            page_table=page_table.contiguous(),
            seq_lens=seq.contiguous(),
            masks=masks,
            local_page_table=self._local(fb, rows, page_table.shape[1]),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        k_pages, v_pages = self.store_kv(k, v, layer, forward_batch)
        if k_pages.dtype != q.dtype:  # float32 activations over a bfloat16 pool: attend as bfloat16 does
            return self._attention(q.to(k_pages.dtype), k_pages, v_pages, layer).to(q.dtype)
        return self._attention(q, k_pages, v_pages, layer)

    def _attention(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, layer: RadixAttention
    ) -> torch.Tensor:
        """``[T, Hq * D]`` attention outputs of the batch's queries ``q`` over the stored pages."""
        scaling, window = layer.scaling, layer.sliding_window
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        if self.kernel_rows is not None:
            rows = self.kernel_rows
            table, lens = rows.table(self._is_local(layer)), rows.seq_lens
            sinks = None if layer.sinks is None else layer.sinks.detach().float().contiguous()
            out = self.decode_kernel(
                q, k_pages, v_pages, table, lens, scaling, rows.row_req, window=window, cap=layer.logit_cap,
                sinks=sinks,
            )  # fmt: skip
            return out.view(num_tokens, -1)
        if len(self.groups) == 1:
            return self._attend(q, k_pages, v_pages, self.groups[0], layer)
        out = q.new_empty(num_tokens, self.num_heads * self.head_dim)
        for group in self.groups:
            out[group.out_index] = self._attend(q, k_pages, v_pages, group, layer)
        return out

    def _attend(
        self,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        group: _Group,
        layer: RadixAttention,
    ) -> torch.Tensor:
        """Outputs ``[n_valid, Hq * D]`` of the group's valid queries, row-major."""
        rows, max_q = group.query_index.shape
        scaling, mask = layer.scaling, group.masks[layer.sliding_window]
        hkv, d = self.num_kv_heads, self.head_dim
        g = self.num_heads // hkv
        # [Bg, Lq, Hkv, G, D] -> [Bg, Hkv, G * Lq, D]: the G heads sharing a KV head become extra queries
        qg = q[group.query_index].view(rows, max_q, hkv, g, d)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(rows, hkv, g * max_q, d)
        pages = (group.local_page_table if self._is_local(layer) else group.page_table).view(-1)
        kg = k_pages.index_select(0, pages).view(rows, -1, hkv, d).transpose(1, 2)  # [Bg, Hkv, Lk, D]
        vg = v_pages.index_select(0, pages).view(rows, -1, hkv, d).transpose(1, 2)
        if self.score_mods:
            out = attend_with_score_mods(qg, kg, vg, mask, layer, max_q)
        else:
            out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scaling)
        out = out.view(rows, hkv, g, max_q, d).permute(0, 3, 1, 2, 4).reshape(rows, max_q, self.num_heads * d)
        return out.view(rows, -1) if group.query_valid is None else out[group.query_valid]
