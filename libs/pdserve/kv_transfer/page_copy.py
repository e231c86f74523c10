"""Gather KV pages of every layer into a staging slot, and scatter a slot back into pages.

A slot holding ``n`` pages is ``[planes, n, page_elems]`` (plane = (layer, k/v), plane-major like the
pool), packed from its start, so it is one contiguous region whatever ``n``. On CPU the copies are
numpy row copies of the pool's bytes, one page (``planes`` rows of ``page_bytes``) at a time: they run
on one thread with the GIL released, next to the forward's OpenMP team instead of starting a second
one (torch's copies would); ``index_copy_`` was 2-3x slower than that on the 2-core Zen 3. On CUDA
they are one ``index_select`` / ``index_copy_`` kernel each on a side stream, synchronized before the
slot is sent or acknowledged (a transfer reads pages written by forwards whose results the scheduler
has already read back, so the default stream needs no waiting for).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class PageCopier:
    """Copies between the pool ``kv_data`` ``[layers, 2, num_pages, ...]`` and flat staging slots.

    Args:
        kv_data: the registered pool tensor, contiguous.
    """

    def __init__(self, kv_data: torch.Tensor):
        self.planes = kv_data.shape[0] * kv_data.shape[1]
        self.num_pages = kv_data.shape[2]
        self.page_elems = kv_data[0, 0, 0].numel()
        self.span_elems = self.planes * self.page_elems  # one page of every plane
        self.span_bytes = self.span_elems * kv_data.element_size()
        self.device = kv_data.device
        self._pool = kv_data.view(self.planes, self.num_pages, self.page_elems)
        self._pool_bytes = _bytes(self._pool) if kv_data.device.type == "cpu" else None
        # a side stream: copies never queue behind (or wait for) a forward on the default stream
        self._stream = torch.cuda.Stream(kv_data.device) if kv_data.is_cuda else None

    def gather(self, pages: Sequence[int], slot: torch.Tensor) -> int:
        """Copy ``pages`` (every plane) into the start of ``slot`` (flat, the pool's dtype); returns bytes."""
        n = len(pages)
        out = slot[: n * self.span_elems].view(self.planes, n, self.page_elems)
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                index = torch.as_tensor(pages, dtype=torch.int64, device=self.device)
                torch.index_select(self._pool, 1, index, out=out)
            self._stream.synchronize()
        else:
            dst, src = _bytes(out), self._pool_bytes
            for j, page in enumerate(pages):
                dst[:, j] = src[:, page]
        return n * self.span_bytes

    def scatter(self, slot: torch.Tensor, pages: Sequence[int]) -> None:
        """Copy the first ``len(pages)`` pages held in ``slot`` into ``pages`` of the pool."""
        n = len(pages)
        src = slot[: n * self.span_elems].view(self.planes, n, self.page_elems)
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                index = torch.as_tensor(pages, dtype=torch.int64, device=self.device)
                self._pool.index_copy_(1, index, src)
            self._stream.synchronize()
        else:
            dst, rows = self._pool_bytes, _bytes(src)
            for j, page in enumerate(pages):
                dst[:, page] = rows[:, j]


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view ``[..., last_dim * itemsize]`` of a CPU tensor whose last dim is contiguous."""
    return t.view(torch.uint8).numpy()
