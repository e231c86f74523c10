"""Token embedding with an uninitialised weight (every value comes from the checkpoint)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """``weight[input_ids]``: int64 ``[T]`` → ``[T, hidden]``; ``weight`` ``[vocab, hidden]`` doubles as
    the LM head of tied-embedding models."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
