"""Attention in PyTorch ops (any device), with C kernels on CPU: the CPU backend.

On CPU the C kernels read the KV pages in place. Decoding requests run as rows of
``cpu_decode_kernel``: the token at position ``p`` of request ``b`` attends to keys ``[0, p]`` of
its request, so a row needs only its request's page table and the length ``p + 1`` (its own key is
stored before attention runs). Extending requests (several new tokens) run as query tiles of
``cpu_extend_kernel``: a vector lane per query, so a tile reads each key once (a fresh 128-token
prompt of SmolLM2 on AVX2: its whole prefill step 7-9% faster than through gather + SDPA; 16
requests x 31 tokens after a shared 1,008-token prefix in bfloat16 on AVX512_BF16: ~5 vs ~11 ms
per layer).

A verifying request (speculative decoding: its last token and ``k`` draft tokens, with logits at
each; ``ForwardBatch.logits_lens`` > 1) runs as decode-kernel rows, one per token, the token at
position ``p`` attending keys ``[0, p]``: so a verify step computes, bit for bit where the matmuls
are per row (our CPU matmuls), what decoding those tokens one at a time computes, and greedy
speculation gives the tokens greedy decoding gives. For the few tokens of a verify this was also
faster than extend tiles (SmolLM2 float32+w4a8, one thread, 130-token contexts: 12.7 vs 14.3 ms a
step at batch 1 and k = 2, 81.6 vs 106.6 ms at batch 16; 219.6 vs 231.9 ms at batch 16 and k = 8).

Otherwise (no C kernels, another device, or a head_dim the extend kernel lacks) requests are split
into at most two groups, decoding ones (one query token; the C decode kernel where it runs) and
extending ones (a ragged chunk after a cached prefix, verifying requests among them), so a MIXED
batch does not pad its decodes to the longest extend. Each extending request's KV pages are
gathered into a padded batch and attended with one SDPA per layer: queries padded to ``Lq`` (the
longest chunk), keys to ``Lk`` (the longest sequence, in whole pages; position ``p`` of a request
is offset ``p % page_size`` of page ``req_to_token[p] // page_size``), and a boolean mask keeps,
for the query at position ``p``, the keys at positions ``[0, p]`` of its own request. GQA needs no
K/V repeat: the ``G = Hq / Hkv`` query heads sharing a KV head are folded into the query-length
axis, so SDPA sees ``Hkv`` heads of ``G * Lq`` queries.

Sliding-window layers pass their window to the C kernels (each query's keys start ``window - 1``
positions back) or get a mask of their own (one per distinct window, built once per batch). Layers
whose scores the kernels and SDPA cannot modify (Gemma 2's soft-capping, gpt-oss's sinks) run the
gather path with explicit scores (``score_mods``) for the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pdserve.layers.attention.base import AttentionBackend
from pdserve.layers.attention.cpu_decode_kernel import load_decode_kernel
from pdserve.layers.attention.cpu_extend_kernel import load_extend_kernel
from pdserve.layers.attention.score_mods import attend_with_score_mods, needs_score_mods
from pdserve.layers.radix_attention import RadixAttention

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
            Lk]``: True where the query may attend to the key (empty for a decode group the C
            kernel runs).
    """

    query_index: torch.Tensor
    query_valid: torch.Tensor | None
    out_index: torch.Tensor | None
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    masks: dict[int, torch.Tensor]


@dataclass(slots=True)
class _KernelRows:
    """One decode-kernel row per token of some or all of the batch's tokens.

    Attributes:
        page_table: int64 ``[N, max_pages]``: the KV pages of each token's request.
        seq_lens: int64 ``[N]``: keys each token attends to (its position + 1).
        token_index: int64 ``[N]``: the tokens' flat indices, or None when they are all ``T`` tokens
            in batch order.
    """

    page_table: torch.Tensor
    seq_lens: torch.Tensor
    token_index: torch.Tensor | None = None


@dataclass(slots=True)
class _ExtendTiles:
    """The extending requests (more than one new token) of the batch, for the extend kernel.

    Attributes:
        page_table: int64 ``[R, max_pages]``; prefix_lens / extend_lens: int64 ``[R]``;
        row_starts: int64 ``[R]``: flat index of each request's first new token.
    """

    page_table: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    row_starts: torch.Tensor


class TorchNativeAttnBackend(AttentionBackend):
    """Paged attention for any device PyTorch runs on; the CPU backend pdserve tests with.

    Args:
        runner: the ``ModelRunner`` (model config, KV pool, device; its loaded model's attention
            layers, for their sliding windows and score modifications).
        use_cpu_kernels: on CPU, run attention through the C kernels of ``cpu_decode_kernel`` and
            ``cpu_extend_kernel`` where they build and support the dtype, instead of gather + SDPA.
    """

    def __init__(self, runner: Any, use_cpu_kernels: bool = True):
        config = runner.model_config
        model = getattr(runner, "model", None)
        layers = [m for m in model.modules() if isinstance(m, RadixAttention)] if model is not None else []
        self.windows = sorted({layer.sliding_window for layer in layers} | {0})
        self.score_mods = any(needs_score_mods(layer) for layer in layers)
        on_cpu = use_cpu_kernels and runner.device.type == "cpu" and not self.score_mods
        decode_kernel = load_decode_kernel() if on_cpu else None
        extend_kernel = load_extend_kernel() if on_cpu else None
        kv_dtype = runner.kv_pool.dtype  # the kernels run in the pool's dtype (queries rounded to it)
        self.decode_kernel = decode_kernel if decode_kernel and decode_kernel.supports(kv_dtype) else None
        supported = extend_kernel and extend_kernel.supports(kv_dtype, config.head_dim)
        self.extend_kernel = extend_kernel if self.decode_kernel and supported else None
        self.num_heads = config.num_local_heads
        self.num_kv_heads = config.num_local_kv_heads
        self.head_dim = config.head_dim
        self.page_size = runner.kv_pool.page_size
        self.groups: list[_Group] = []
        self.kernel_rows: _KernelRows | None = None
        self.tiles: _ExtendTiles | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        self.groups, self.kernel_rows, self.tiles = [], None, None
        extending = fb.extend_seq_lens > 1
        if self.decode_kernel is not None:  # verifying requests attend as the decodes they stand for
            extending &= fb.logits_lens == 1
        extend_rows = extending.nonzero().squeeze(1)
        decode_rows = (~extending).nonzero().squeeze(1)
        if self.extend_kernel is not None and len(extend_rows):
            self.tiles = self._tiles(fb, extend_rows)
            if len(decode_rows):
                self.kernel_rows = self._token_rows(fb, decode_rows)
            return
        if len(extend_rows) == 0 and self.decode_kernel is not None:
            self.kernel_rows = self._token_rows(fb, decode_rows)
            return
        if len(decode_rows) == 0 or len(extend_rows) == 0:
            self.groups = [self._group(fb, None)]
        else:
            self.groups = [self._group(fb, decode_rows), self._group(fb, extend_rows)]

    def _tiles(self, fb: ForwardBatch, rows: torch.Tensor) -> _ExtendTiles:
        """The extending requests ``rows`` for the extend kernel."""
        page_table = self._page_table(fb, fb.req_pool_indices[rows], fb.seq_lens[rows])
        return _ExtendTiles(
            page_table.contiguous(),
            fb.extend_prefix_lens[rows].contiguous(),
            fb.extend_seq_lens[rows].contiguous(),
            fb.extend_start_loc[rows].contiguous(),
        )

    def _token_rows(self, fb: ForwardBatch, rows: torch.Tensor) -> _KernelRows:
        """Decode-kernel rows of every token of the requests ``rows``: decodes (one token), and
        verifying requests, whose token at position ``p`` attends keys ``[0, p]`` as a decode of
        that position does, so a verify step computes what decoding its tokens one at a time
        computes (the extend kernel's reduction order differs from the decode kernel's)."""
        lens = fb.extend_seq_lens[rows]
        page_table = self._page_table(fb, fb.req_pool_indices[rows], fb.seq_lens[rows])
        starts = fb.extend_start_loc[rows]
        if len(rows) == int(lens.sum()):  # one token each
            tokens = starts
        else:
            page_table = page_table.repeat_interleave(lens, dim=0)
            first = torch.cumsum(lens, 0) - lens
            tokens = torch.arange(int(lens.sum()), device=lens.device) + torch.repeat_interleave(
                starts - first, lens
            )
        every = len(tokens) == len(fb.positions)  # rows are all requests, so tokens are 0 .. T - 1
        return _KernelRows(
            page_table.contiguous(), (fb.positions[tokens] + 1).contiguous(), None if every else tokens
        )

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
        masks = {}
        if max_q > 1 or self.decode_kernel is None:  # the decode kernel needs only the lengths
            k_pos = torch.arange(max_k, device=device)[None, None, :]
            q_abs = (prefix[:, None] + q_pos)[:, :, None]
            causal = (k_pos <= q_abs) & (k_pos < seq[:, None, None])  # [Bg, Lq, Lk]
            g = self.num_heads // self.num_kv_heads
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
        if self.tiles is not None:
            tiles = self.tiles
            out = q.new_empty(num_tokens, self.num_heads, self.head_dim)
            self.extend_kernel(
                q,
                k_pages,
                v_pages,
                tiles.page_table,
                tiles.prefix_lens,
                tiles.extend_lens,
                tiles.row_starts,
                scaling,
                out=out,
                window=window,
            )
            if self.kernel_rows is not None:
                rows = self.kernel_rows
                queries = q[rows.token_index]
                out[rows.token_index] = self.decode_kernel(
                    queries, k_pages, v_pages, rows.page_table, rows.seq_lens, scaling, window=window
                )
            return out.view(num_tokens, -1)
        if self.kernel_rows is not None:
            rows = self.kernel_rows
            out = self.decode_kernel(
                q, k_pages, v_pages, rows.page_table, rows.seq_lens, scaling, window=window
            )
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
        scaling, mask = layer.scaling, group.masks.get(layer.sliding_window)
        if max_q == 1 and self.decode_kernel is not None:
            queries = q[group.query_index[:, 0]]
            out = self.decode_kernel(
                queries,
                k_pages,
                v_pages,
                group.page_table,
                group.seq_lens,
                scaling,
                window=layer.sliding_window,
            )
            return out.view(rows, -1)
        hkv, d = self.num_kv_heads, self.head_dim
        g = self.num_heads // hkv
        # [Bg, Lq, Hkv, G, D] -> [Bg, Hkv, G * Lq, D]: the G heads sharing a KV head become extra queries
        qg = q[group.query_index].view(rows, max_q, hkv, g, d)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(rows, hkv, g * max_q, d)
        pages = group.page_table.view(-1)
        kg = k_pages.index_select(0, pages).view(rows, -1, hkv, d).transpose(1, 2)  # [Bg, Hkv, Lk, D]
        vg = v_pages.index_select(0, pages).view(rows, -1, hkv, d).transpose(1, 2)
        if self.score_mods:
            out = attend_with_score_mods(qg, kg, vg, mask, layer, max_q)
        else:
            out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scaling)
        out = out.view(rows, hkv, g, max_q, d).permute(0, 3, 1, 2, 4).reshape(rows, max_q, self.num_heads * d)
        return out.view(rows, -1) if group.query_valid is None else out[group.query_valid]
