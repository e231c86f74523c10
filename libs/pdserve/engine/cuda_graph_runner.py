"""``CudaGraphRunner``: DECODE forwards captured once per padded batch size, then replayed (SGLang's
``cuda_graph_runner.py``; the mechanism is CUDA Graphs, NVIDIA CUDA C++ Programming Guide).

A decode step of a small model is a few hundred short kernels. Launched one at a time from Python
the GPU idles while the CPU works: SmolLM2-135M at batch 1 took 19 ms a step on an H200 that way,
nearly all of it CPU time. A replayed graph launches the whole forward (embedding to logits) in
one call; only the attention plan (page tables, on the CPU) and the sampler run outside it.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from typing import Any

import torch

from pdserve.engine.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16, up to ``max_batch_size``
    (included). A batch runs in the smallest one that holds it."""
    sizes = [bs for bs in (1, 2, 4, 8, *range(16, max_batch_size, 16)) if bs < max_batch_size]
    return [*sizes, max_batch_size]


class CudaGraphRunner:
    """Captures ``model.forward`` + ``compute_logits`` of DECODE batches and replays them.

    A batch of ``n`` requests runs in the graph of the smallest captured size ``bs >= n``. Its
    input ids, positions and KV slots are copied into fixed buffers; rows ``n..bs`` are padding:
    token 0 at position 0, written into and attending to the pool's padding page (``pad_page``,
    which the allocator never hands out), and their logits are dropped. Graphs are captured
    largest first and share one memory pool, so replays must not overlap (one scheduler thread).

    Args:
        runner: the ``ModelRunner``; its attention backend must set ``supports_cuda_graph``.
        max_batch_size: the largest batch captured; larger DECODE batches run eagerly.
        pad_page: index of the KV pool page reserved for padded rows.
    """

    def __init__(self, runner: Any, max_batch_size: int, pad_page: int):
        start = time.perf_counter()
        self.runner = runner
        self.backend = runner.attn_backend
        self.batch_sizes = capture_batch_sizes(max_batch_size)
        self.pad_slot = pad_page * runner.kv_pool.page_size
        max_bs = self.batch_sizes[-1]
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=runner.device)
        self.positions = torch.zeros_like(self.input_ids)
        self.out_cache_loc = torch.full_like(self.input_ids, self.pad_slot)
        self.backend.init_cuda_graph_state(self.batch_sizes, pad_page)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = None
        for bs in reversed(self.batch_sizes):  # largest first: the smaller graphs reuse its memory
            self.graphs[bs], self.logits[bs] = self._capture(bs, pool)
            pool = self.graphs[bs].pool()
        logger.info(
            "captured CUDA graphs of decode batch sizes %s in %.1f s",
            self.batch_sizes,
            time.perf_counter() - start,
        )

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return (
            forward_batch.forward_mode is ForwardMode.DECODE
            and forward_batch.batch_size <= self.batch_sizes[-1]
        )

    @torch.inference_mode()
    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[n, vocab]`` (model dtype) of a DECODE batch of ``n <= max_batch_size`` requests,
        whose KV this writes as an eager forward would."""
        fb, n = forward_batch, forward_batch.batch_size
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        self.input_ids[:n].copy_(fb.input_ids)
        self.positions[:n].copy_(fb.positions)
        self.out_cache_loc[:n].copy_(fb.out_cache_loc)
        self.input_ids[n:bs].zero_()
        self.positions[n:bs].zero_()
        self.out_cache_loc[n:bs].fill_(self.pad_slot)
        self.backend.init_forward_metadata_replay_cuda_graph(bs, fb)
        self.graphs[bs].replay()
        return self.logits[bs][:n]

    @torch.inference_mode()
    def _capture(self, bs: int, pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream, then capture (the pattern of PyTorch's CUDA Graphs notes)."""
        fb = self._padded_batch(bs)
        self.backend.init_forward_metadata_capture_cuda_graph(bs)
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(fb)
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._forward(fb)
        return graph, logits

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        model = self.runner.model
        return model.compute_logits(model(fb.input_ids, fb.positions, fb))

    def _padded_batch(self, bs: int) -> ForwardBatch:
        """A DECODE ``ForwardBatch`` of ``bs`` padded rows whose ids, positions and KV slots are
        views of the fixed input buffers (its lengths and request slots are only read by the
        attention plan, outside the graph)."""
        fb = ForwardBatch.init_new(
            input_ids=[0] * bs,
            req_pool_indices=[0] * bs,
            seq_lens=[1] * bs,
            extend_seq_lens=[1] * bs,
            out_cache_loc=[self.pad_slot] * bs,
            forward_mode=ForwardMode.DECODE,
            runner=self.runner,
        )
        return dataclasses.replace(
            fb,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
        )
