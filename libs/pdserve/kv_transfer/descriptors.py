"""Page lists → NIXL transfer descriptors over the page-major pool ``[page, layer, kv, slot, head, dim]``.

Page ``p`` of every layer (K and V) is the byte range ``[base + p * page_bytes, base + (p + 1) *
page_bytes)``, so a run of ``n`` pages that is consecutive on both sides moves as one descriptor
(likewise in the local layers' pool of an SWA pool, ``KVAgentInfo.transfer_pages``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdserve.kv_transfer.layout import KVAgentInfo

PageRun = tuple[int, int, int]
"""``(src_start, dst_start, n)``: pages ``src_start + i`` go to ``dst_start + i`` for ``i < n``."""


def coalesce(
    src_pages: Sequence[int], dst_pages: Sequence[int], src_split: int = -1, dst_split: int = -1
) -> list[PageRun]:
    """Merge page pairs into runs that are consecutive on both sides.

    Pairs are ordered by source page first (a WRITE does not depend on order), so
    ``src=[5, 3, 4], dst=[7, 5, 6]`` is the single run ``(3, 5, 3)``. A run never crosses
    ``src_split`` / ``dst_split`` (the first local-pool page of each side's transfer space,
    ``KVAgentInfo.transfer_pages``): the two pools are two byte ranges.

    Raises:
        ValueError: the lists differ in length, or a destination page appears twice.
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    if len(set(dst_pages)) != len(dst_pages):
        raise ValueError("a destination page appears more than once")
    runs: list[PageRun] = []
    for src, dst in sorted(zip(src_pages, dst_pages, strict=True)):
        if runs:
            src_start, dst_start, n = runs[-1]
            if src == src_start + n and dst == dst_start + n and src != src_split and dst != dst_split:
                runs[-1] = (src_start, dst_start, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def page_run_descs(pool: KVAgentInfo, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """NIXL ``(addr, len, dev_id)`` rows for runs of ``counts[i]`` pages from ``starts[i]`` in ``pool``.

    Args:
        pool: the pool's agent info (base addresses, layout, device).
        starts, counts: int64 arrays ``[num_runs]``, pages of its transfer space (a run within one
            of its two pools: ``coalesce``'s splits).

    Returns:
        uint64 array ``[num_runs, 3]``: one descriptor per run, every layer's K and V in it.
    """
    addrs, page_bytes = pool.page_addrs(starts)
    descs = np.empty((len(starts), 3), dtype=np.uint64)
    descs[:, 0] = addrs
    descs[:, 1] = counts.astype(np.uint64) * page_bytes
    descs[:, 2] = max(pool.device_id, 0)
    return descs


def head_slice_descs(pool: KVAgentInfo, pages: np.ndarray, head: int, num_heads: int) -> np.ndarray:
    """NIXL ``(addr, len, dev_id)`` rows for heads ``[head, head + num_heads)`` of ``pages`` of the pool.

    Within a page the heads are the second-innermost axis, so each ``(layer, kv, slot)`` row of a page
    holds the slice as one contiguous ``num_heads * head_dim * itemsize`` bytes, ``num_kv_heads *
    head_dim * itemsize`` bytes after the previous row's: one descriptor per row.

    Args:
        pool: the pool's agent info (its pool only: no local layers' pool).
        pages: int64 ``[n]`` pages of the pool, in the order their rows are paired with the peer's.
        head, num_heads: the slice, along this pool's own ``head`` axis.

    Returns:
        uint64 array ``[n * rows, 3]``, ``rows = num_layers * 2 * page_size`` (the pool's layers), page-major.
    """
    layout = pool.layout
    num_rows = (layout.num_layers - layout.num_local_layers) * 2 * layout.page_size
    row_bytes = layout.page_bytes // num_rows
    head_bytes = row_bytes // layout.num_kv_heads
    rows = np.arange(num_rows, dtype=np.uint64) * np.uint64(row_bytes)
    page_addrs = np.uint64(pool.base_addr) + pages.astype(np.uint64) * np.uint64(layout.page_bytes)
    descs = np.empty((len(pages) * len(rows), 3), dtype=np.uint64)
    descs[:, 0] = (page_addrs[:, None] + rows[None, :] + np.uint64(head * head_bytes)).reshape(-1)
    descs[:, 1] = num_heads * head_bytes
    descs[:, 2] = max(pool.device_id, 0)
    return descs
