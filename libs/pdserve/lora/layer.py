"""The low-rank delta of one base linear layer, for a batch that mixes adapters (Punica's SGMV,
Chen et al. 2023; S-LoRA, Sheng et al. 2023): a shrink ``x @ A[slot]^T`` and an expand
``@ B[slot]^T`` per adapter segment of the batch, added to the base layer's output.

Every adapter the worker holds has a slot of fixed stacked float32 buffers, stored transposed
(``A^T`` ``[max_loras, in, S * R]`` for the ``S`` fused shards of the layer, which must tile its
output in order; ``B^T`` ``[max_loras, R, size_s]`` per shard; ``R`` = ``--max-lora-rank``; an
adapter of lower rank, or one that does not target a shard, leaves zeros). Tokens of the base model
(slot -1) get no delta. On CPU the whole delta is one C call (``lora/bgmv.py``, Punica's BGMV: each
token gathers its own adapter's weights). Elsewhere (or with the CPU kernels off) the segments run
as torch matmuls, one shrink and one expand per shard per adapter present in the batch, into one
float32 ``[T, out]`` delta added to the output at the end. Each choice of that path dodges a slow
path of torch's CPU ops measured on a Sapphire Rapids-class Xeon (docs/lora.md "Measured"):
matmuls of a few bfloat16 rows (milliseconds each, float32's take microseconds), a matmul against
a transposed weight (``F.linear``; stalls of milliseconds with two threads), a matmul of 8 rows
split over two threads (~1.6 ms each when another job holds a core; the delta's matmuls run on
one thread), and ``index_add_`` into a column slice of the output (~0.5 ms each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.lora.bgmv import BgmvWeights, load_bgmv

BASE_SLOT = -1  # a token of the base model: no delta


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """A step's tokens: each one's slot (``token_slots``, int64 ``[T]``, contiguous, ``BASE_SLOT`` for
    base tokens), grouped by adapter (``groups``: ``(slot, token indices int64 [n])`` per adapter
    present), and those groups' indices one after another (``order``, int64 ``[n]``)."""

    token_slots: torch.Tensor
    groups: list[tuple[int, torch.Tensor]]
    order: torch.Tensor

    @classmethod
    def of(cls, token_slots: torch.Tensor) -> LoraBatch | None:
        """Group ``token_slots`` (int64 ``[T]``, ``BASE_SLOT`` for base tokens); None when no token
        has an adapter."""
        slots = [s for s in torch.unique(token_slots).tolist() if s != BASE_SLOT]
        if not slots:
            return None
        groups = [(s, (token_slots == s).nonzero().squeeze(1)) for s in slots]
        return cls(token_slots.contiguous(), groups, torch.cat([index for _, index in groups]))


class LoraState:
    """What every adapted layer of one model reads during a forward: the step's ``LoraBatch`` (None:
    no token has an adapter), set by ``LoraManager.prepare`` before the layers run."""

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None


class LoraSlots:
    """The stacked adapter weights of one base linear layer and the delta they add.

    Args:
        in_features: the layer's input features.
        shards: ``(offset, size)`` of each fused output shard (one for an unfused layer).
        max_loras / max_rank: slots and rank ``R`` of the buffers (float32).
        state: the model's shared ``LoraState``.
    """

    def __init__(
        self,
        in_features: int,
        shards: Sequence[tuple[int, int]],
        max_loras: int,
        max_rank: int,
        state: LoraState,
    ):
        self.shards = list(shards)
        self.rank = max_rank
        if [offset for offset, _ in self.shards] != [
            sum(size for _, size in self.shards[:i]) for i in range(len(self.shards))
        ]:
            raise ValueError(f"shards {self.shards} do not tile the output in order")
        self.a = torch.zeros(max_loras, in_features, len(self.shards) * max_rank)
        self.b = [torch.zeros(max_loras, max_rank, size) for _, size in self.shards]
        self.state = state
        self.weights = BgmvWeights(self.a, self.b)

    def write(self, slot: int, shard: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put shard ``shard``'s ``A`` ``[r, in]`` and ``B`` ``[size, r]`` (scaling folded in) into
        ``slot``; None for both clears it (the adapter does not target this shard)."""
        a_t = self.a[slot, :, shard * self.rank : (shard + 1) * self.rank]
        b_t = self.b[shard][slot]
        a_t.zero_()
        b_t.zero_()
        if a is not None:
            a_t[:, : a.shape[0]] = a.T
            b_t[: b.shape[1]] = b.T

    @property
    def active(self) -> bool:
        """Whether the running step has tokens of an adapter (the layer must run unfused)."""
        return self.state.batch is not None

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` ``[T, out]`` (the base layer's output for ``x`` ``[T, in]``) plus each token's delta
        ``(x @ A[slot]^T) @ B[slot]^T`` (computed in float32), in place; returns ``y``."""
        batch = self.state.batch
        if batch is None:
            return y
        bgmv = load_bgmv() if x.device.type == "cpu" else None
        if bgmv is not None and bgmv.supports(x, y):
            bgmv.add_(x, y, batch.token_slots, batch.order, self.weights)
            return y
        r = self.rank
        x = x.float()
        delta = x.new_zeros(y.shape)  # base tokens' rows stay zero
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # too small to split: a parallel one waits on a busy core
        try:
            for slot, index in batch.groups:
                shrunk = x.index_select(0, index) @ self.a[slot]
                rows = [shrunk[:, s * r : (s + 1) * r] @ self.b[s][slot] for s in range(len(self.shards))]
                delta.index_copy_(0, index, torch.cat(rows, dim=1))
        finally:
            torch.set_num_threads(threads)
        return y.add_(delta)
