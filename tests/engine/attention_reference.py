"""Plain float64 paged attention for the CPU kernels' tests, and the tolerance they are held to."""

from __future__ import annotations

import torch


def reference(
    q, k_pages, v_pages, page_table, seq_lens, scale, window=0, cap=0.0, sinks=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each request's query over its keys (its last ``window`` ones when given),
    in float64, one request at a time, and the same weights over |V| (the scale of rounding the
    weights to bfloat16). ``cap``: scores soft-capped, ``cap * tanh(s / cap)``; ``sinks``: ``[Hq]``
    logits that join each head's softmax as a key without a value (as HF's eager gpt-oss)."""
    _, page_size, num_kv_heads, head_dim = k_pages.shape
    group = q.shape[1] // num_kv_heads
    out, magnitude = [], []
    for b, n in enumerate(seq_lens.tolist()):
        slots = torch.arange(max(0, n - window) if window else 0, n)
        pages = page_table[b, slots // page_size]
        k = k_pages[pages, slots % page_size].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_pages[pages, slots % page_size].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale
        if cap:
            scores = cap * torch.tanh(scores / cap)
        if sinks is None:
            weights = torch.softmax(scores, dim=-1)
        else:
            weights = torch.softmax(torch.cat([scores, sinks.double()[:, None]], dim=-1), dim=-1)[:, :-1]
        out.append(torch.einsum("hn,nhd->hd", weights, v))
        magnitude.append(torch.einsum("hn,nhd->hd", weights, v.abs()))
    return torch.stack(out), torch.stack(magnitude)


def row_reference(q, k_pages, v_pages, page_table, prefix_lens, extend_lens, row_starts, scale, window=0):
    """Per query row of the requests: the float64 reference of a decode row with the request's pages
    and length (its position + 1), over its last ``window`` keys when given."""
    rows = torch.cat([start + torch.arange(n) for start, n in zip(row_starts, extend_lens, strict=True)])
    row_table = page_table.repeat_interleave(extend_lens, dim=0)
    row_lens = torch.cat([p + 1 + torch.arange(n) for p, n in zip(prefix_lens, extend_lens, strict=True)])
    expected, magnitude = reference(q[rows], k_pages, v_pages, row_table, row_lens, scale, window)
    return {int(row): (expected[i], magnitude[i]) for i, row in enumerate(rows)}


def hide_keys_before(k_pages, v_pages, page_table, firsts) -> None:
    """NaN into the K/V of request ``b``'s positions before ``firsts[b]`` (keys no query of it may
    read: a sliding window has passed them), so that a kernel reading one shows in its output."""
    page_size = k_pages.shape[1]
    for b, first in enumerate(firsts):
        slots = torch.arange(int(first))
        rows, cols = page_table[b, slots // page_size], slots % page_size
        k_pages[rows, cols] = torch.nan
        v_pages[rows, cols] = torch.nan


def assert_matches(
    out: torch.Tensor, reference: tuple[torch.Tensor, torch.Tensor], score_bound: float = 0.0
) -> None:
    """float32: arithmetic-rounding close (1e-5 relative, 1e-6 absolute), plus, for scores up to
    ``score_bound`` in magnitude, what rounding them to float32 (2^-24 relative) moves the weights by,
    over ``|V|`` and the output (float32 SDPA errs as much: ~0.05-0.1 of that term on peaked scores);
    bfloat16: within the output's own rounding and that of the attention weights: 2^-8 relative
    each, of the output and of the weights over |V|."""
    expected, magnitude = reference
    assert not out.isnan().any()
    error = (out.double() - expected).abs()
    if out.dtype == torch.float32:
        bound = 1e-6 + 1e-5 * expected.abs() + 2**-24 * score_bound * (expected.abs() + magnitude)
    else:
        bound = 2**-8 * (expected.abs() + magnitude) + 1e-5
    assert bool((error <= bound).all()), f"worst error / bound {float((error / bound).max()):.2f}"
