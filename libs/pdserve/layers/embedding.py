"""Token embedding split by vocabulary rows across TP ranks (Megatron-LM's vocabulary-parallel
embedding), with an uninitialised weight: every value comes from the checkpoint."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed import SINGLE_RANK, TpGroup, vocab_shard
from pdserve.layers.linear import checkpoint_shape, default_weight_loader


class VocabParallelEmbedding(nn.Module):
    """``weight[input_ids]``: int64 ``[T]`` → ``[T, hidden]``.

    Rank ``r`` holds vocabulary rows ``[vocab_start, vocab_end)`` (``vocab_shard``; its ``weight`` is
    ``[ceil(vocab / tp), hidden]``, zero-padded): it looks up the ids it holds, zeros the others, and
    an all-reduce sums the ranks' rows (exactly one rank contributes each row, so the sum is exact).
    The weight doubles as the LM head of tied-embedding models (each rank: its slice of the logits).
    With one rank this is a plain ``F.embedding``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TpGroup = SINGLE_RANK):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_end, rows = vocab_shard(vocab_size, tp.size, tp.rank)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self._load_weight

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor | Any) -> None:
        """Copy this rank's rows of the checkpoint's ``[vocab, hidden]`` matrix; zero the padding.

        Raises:
            ValueError: the checkpoint matrix is not ``[vocab_size, hidden]``.
        """
        shape = checkpoint_shape(loaded)
        if shape != (self.vocab_size, param.shape[1]):
            raise ValueError(
                f"checkpoint embedding of shape {shape} does not fit ({self.vocab_size}, {param.shape[1]})"
            )
        n = self.vocab_end - self.vocab_start
        default_weight_loader(param.data[:n], loaded[self.vocab_start : self.vocab_end])
        param.data[n:] = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight).masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(out)
