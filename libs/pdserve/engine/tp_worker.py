"""``TpModelWorker``: the seam between a scheduler and the ``ModelRunner`` of one TP rank (SGLang's
``tp_worker.py``; the design brief's section on the TP worker).

Every rank of a scheduler runs the same ``ForwardBatch`` (its scheduler decided it identically)
through its shard of the model; the layers' collectives combine the shards and every rank ends
with the same gathered logits. Only rank 0 samples them, and broadcasts its
``GenerationBatchResult``, so every rank's scheduler appends the same tokens whatever the sampling
(an unseeded random draw comes from rank 0's generator alone). With one rank the worker is the
runner's own ``forward_batch_generation``.
"""

from __future__ import annotations

import torch

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.model_runner import ModelRunner
from pdserve.sampling.sampler import GenerationBatchResult


class TpModelWorker:
    """Runs forward batches on one rank's ``ModelRunner`` (which holds its ``TpGroup``).

    The scheduler and ``ForwardBatch.init_new`` read the runner's pools, config and backend through
    the worker's properties of the same names.
    """

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.tp = runner.tp
        # a forward that raises on a TP group fails the group, not just its requests (batch_runner)
        self.isolates_failures = self.tp.size == 1

    @property
    def model_config(self):
        return self.runner.model_config

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def req_to_token_pool(self):
        return self.runner.req_to_token_pool

    @property
    def token_to_kv_pool_allocator(self):
        return self.runner.token_to_kv_pool_allocator

    @property
    def kv_pool(self):
        return self.runner.kv_pool

    @property
    def swa_pages(self):
        return self.runner.swa_pages

    @property
    def attn_backend(self):
        return self.runner.attn_backend

    @property
    def lora_manager(self):
        return self.runner.lora_manager

    def forward_batch_generation(self, forward_batch: ForwardBatch) -> GenerationBatchResult:
        """Forward on every rank, sample on rank 0, the result broadcast to all ranks.

        Every rank must call this with the same batch, in the same order of steps.
        """
        if self.tp.size == 1:
            return self.runner.forward_batch_generation(forward_batch)
        fb = forward_batch
        logits, pooled = self.runner.forward_pooled_logits(fb)
        result = self.runner.sample(fb, logits) if self.tp.is_driver else None
        result = self._broadcast(result, fb)
        result.pooled = pooled  # every rank's own: the hidden states are all-reduced, the same on each
        return result

    def _broadcast(self, result: GenerationBatchResult | None, fb: ForwardBatch) -> GenerationBatchResult:
        """Rank 0's result on every rank, as one float64 ``[N, 1 (+1 + 2k)]`` tensor (a row per logits
        row: per request, or per position of a verify batch): ids, then the sampled token's logprob
        and the top-``k`` ids and logprobs when asked for (float64 holds token ids and float32
        logprobs exactly). Prompt logprobs are rank 0's alone: only rank 0 emits outputs."""
        num_rows = fb.num_sample_rows
        top_nums = fb.top_logprobs_nums or [0] * num_rows
        k = max(top_nums, default=0)
        with_logprobs = fb.return_logprob or k > 0
        packed = torch.zeros(num_rows, 1 + with_logprobs + 2 * k, dtype=torch.float64)
        if result is not None:
            packed[:, 0] = torch.tensor(result.next_token_ids, dtype=torch.float64)
            if with_logprobs:
                packed[:, 1] = torch.tensor(result.next_token_logprobs, dtype=torch.float64)
            for i, row in enumerate(result.top_logprobs or []):
                for j, (token, logprob) in enumerate(row):
                    packed[i, 2 + j], packed[i, 2 + k + j] = token, logprob
        shared = self.tp.broadcast(packed.to(self.device))  # NCCL broadcasts device tensors
        if result is not None:
            return result
        rows = shared.cpu().tolist()
        ids = shared[:, 0].to(torch.int64)  # on the device: what a batch scheduled ahead decodes from
        out = GenerationBatchResult(next_token_ids=[int(r[0]) for r in rows], next_token_tensor=ids)
        if with_logprobs:
            out.next_token_logprobs = [r[1] for r in rows]
        if k:
            out.top_logprobs = [
                [(int(t), lp) for t, lp in zip(r[2 : 2 + n], r[2 + k : 2 + k + n], strict=True)]
                for r, n in zip(rows, top_nums, strict=True)
            ]
        return out
