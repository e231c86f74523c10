"""``ScheduleBatch``: what one scheduling step runs, built fresh every step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.forward_batch import ForwardBatch, ForwardMode
from pdserve.sampling.sampling_batch_info import SamplingBatchInfo
from pdserve.scheduler.req import Req


@dataclass
class ScheduleBatch:
    """Requests of one step and how many tokens each computes.

    ``extend_lens[i]`` tokens of ``reqs[i].fill_ids`` starting at ``reqs[i].num_computed`` are run;
    a decoding request has ``extend_len == 1`` (its last generated token). Extending requests come
    first, decoding ones after them.
    """

    reqs: list[Req]
    extend_lens: list[int]
    num_extend: int  # the first num_extend reqs extend, the rest decode
    prefix_lens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prefix_lens = [r.num_computed for r in self.reqs]

    @property
    def forward_mode(self) -> ForwardMode:
        if self.num_extend == len(self.reqs):
            return ForwardMode.EXTEND
        if self.num_extend == 0:
            return ForwardMode.DECODE
        return ForwardMode.MIXED

    def is_last_chunk(self, i: int) -> bool:
        """True when step ``i`` completes the request's fill, so its sampled token counts."""
        return self.prefix_lens[i] + self.extend_lens[i] == len(self.reqs[i].fill_ids)

    def to_forward_batch(self, runner) -> ForwardBatch:
        """Build the device contract: ids, pool slots, lengths and sampling info (int64 tensors); the KV
        slots are read from ``req_to_token``, which the ledger wrote when it gave the pages."""
        input_ids: list[int] = []
        for req, start, n in zip(self.reqs, self.prefix_lens, self.extend_lens, strict=True):
            input_ids.extend(req.fill_ids[start : start + n])
        req_pool_indices = torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64)
        prefix = torch.tensor(self.prefix_lens, dtype=torch.int64)
        extend = torch.tensor(self.extend_lens, dtype=torch.int64)
        params = [r.sampling_params for r in self.reqs]
        sampling_info = SamplingBatchInfo.build(
            params,
            output_ids=[r.output_ids for r in self.reqs],
            prompt_ids=[r.origin_input_ids for r in self.reqs],
            eos_token_ids=runner.model_config.eos_token_ids,
            vocab_size=runner.model_config.vocab_size,
            device=runner.device,
            grammars=[r.grammar for r in self.reqs],
        )
        return ForwardBatch.init_new(
            forward_mode=self.forward_mode,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            req_pool_indices=req_pool_indices,
            seq_lens=prefix + extend,
            extend_prefix_lens=prefix,
            extend_seq_lens=extend,
            sampling_info=sampling_info,
            return_logprob=any(p.return_logprob for p in params),
            top_logprobs_nums=[p.top_logprobs_num or 0 for p in params],
            runner=runner,
        )
