"""Tensor-parallel linear layers (Megatron-LM, Shoeybi et al. 2019), as thin subclasses of ``Linear``.

- Column-parallel (``MergedColumnParallelLinear``): rank ``r`` holds a slice of the output rows of
  each fused shard (q/k/v by attention heads, gate/up by intermediate channels, the LM head by
  vocabulary rows), so its output is its slice of the activations and nothing is communicated.
- Row-parallel (``RowParallelLinear``): rank ``r`` holds the input columns matching the previous
  column-parallel layer's rows (``o_proj``, ``down_proj``); the partial products are summed by an
  all-reduce. The bias is added once: rank 0 holds it, the other ranks hold zeros.

Slices may differ in size between ranks (``pdserve.distributed.sharding``: whole GQA groups, split
as evenly as they go), since only the all-reduced outputs must agree in shape.

Each layer's weight loader reads only its rank's slice of the checkpoint matrix: the loader hands
it a lazy safetensors slice and slicing reads those bytes alone. The matmul itself is ``Linear``'s
(packing, quantization), on the local weight. With one rank every layer here is exactly the
``Linear`` / ``MergedLinear`` it subclasses, and Hugging Face parameter names are kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pdserve.distributed import SINGLE_RANK, HeadShard, TpGroup, split_range, vocab_shard
from pdserve.layers.linear import Linear, MergedLinear, checkpoint_shape, default_weight_loader


def _check_rows(name: str, loaded: torch.Tensor | Any, rows: int) -> None:
    if checkpoint_shape(loaded)[0] != rows:
        raise ValueError(
            f"checkpoint tensor for {name} has shape {checkpoint_shape(loaded)}; expected {rows} rows"
        )


class MergedColumnParallelLinear(MergedLinear):
    """Fused shards, each this rank's slice of the rows of its own checkpoint matrix.

    Args:
        in_features: input features (full: column-parallel layers see the whole input).
        shard_names: checkpoint name of each shard (``q``, ``k``, ``v`` or ``gate``, ``up``).
        output_sizes: rows this rank holds of each shard.
        source_starts: first checkpoint row of each shard's slice.
        source_rows: rows of each shard's whole checkpoint matrix (checked at load).
    """

    def __init__(
        self,
        in_features: int,
        shard_names: Sequence[str],
        output_sizes: Sequence[int],
        source_starts: Sequence[int],
        source_rows: Sequence[int],
        bias: bool = False,
    ):
        super().__init__(in_features, output_sizes, shard_names, bias)
        self.sources = dict(zip(shard_names, zip(source_starts, source_rows, strict=True), strict=True))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | Any, shard: str) -> None:
        """Copy this rank's rows of checkpoint shard ``shard`` (weight or bias) into their place."""
        offset, size = self.shards[shard]
        start, rows = self.sources[shard]
        _check_rows(shard, loaded, rows)
        default_weight_loader(param.data.narrow(0, offset, size), loaded[start : start + size])


def qkv_parallel_linear(
    hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, shard: HeadShard, bias: bool
) -> MergedColumnParallelLinear:
    """Fused q/k/v split by heads: the rank's query and KV heads (``head_shard``: whole GQA groups,
    or one replicated KV head when there are fewer KV heads than ranks)."""
    q, kv = shard.num_heads * head_dim, shard.num_kv_heads * head_dim
    return MergedColumnParallelLinear(
        hidden_size,
        ["q", "k", "v"],
        [q, kv, kv],
        [shard.q_start * head_dim, shard.kv_start * head_dim, shard.kv_start * head_dim],
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
        bias,
    )


def gate_up_parallel_linear(
    hidden_size: int, intermediate_size: int, bias: bool, tp: TpGroup = SINGLE_RANK
) -> MergedColumnParallelLinear:
    """Fused gate/up split by intermediate channels (``split_range``; SwiGLU acts channel by
    channel, so each rank's ``silu(gate) * up`` is its slice of the whole)."""
    start, size = split_range(intermediate_size, tp.size, tp.rank)
    return MergedColumnParallelLinear(
        hidden_size, ["gate", "up"], [size, size], [start] * 2, [intermediate_size] * 2, bias
    )


class RowParallelLinear(Linear):
    """``y = all_reduce(x_r W_r^T) (+ b)``: ``x_r`` ``[..., local_in]`` is this rank's slice of the input
    (the output of a column-parallel layer), ``W_r`` columns ``[input_start, input_start + local_in)``
    of the checkpoint's ``[out_features, in_features]`` weight."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        tp: TpGroup = SINGLE_RANK,
        input_start: int = 0,
        local_in: int | None = None,
    ):
        super().__init__(in_features if local_in is None else local_in, out_features, bias)
        self.tp = tp
        self.in_features_total = in_features
        self.input_start = input_start
        self.weight.weight_loader = self._load_weight
        if self.bias is not None:
            self.bias.weight_loader = self._load_bias

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor | Any) -> None:
        full = checkpoint_shape(loaded)
        if full != (param.shape[0], self.in_features_total):
            raise ValueError(
                f"checkpoint weight of shape {full} does not fit row-parallel columns {tuple(param.shape)}"
            )
        default_weight_loader(param, loaded[:, self.input_start : self.input_start + param.shape[1]])

    def _load_bias(self, param: nn.Parameter, loaded: torch.Tensor | Any) -> None:
        default_weight_loader(param, loaded)
        if not self.tp.is_driver:
            param.data.zero_()  # the all-reduce adds rank 0's bias once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class ParallelLMHead(Linear):
    """An untied LM head split by vocabulary rows (``vocab_shard``): ``[N, hidden]`` → this rank's
    ``[N, ceil(vocab / tp)]`` slice of the logits (padding rows are zero); the model gathers them."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TpGroup = SINGLE_RANK):
        start, end, rows = vocab_shard(vocab_size, tp.size, tp.rank)
        super().__init__(hidden_size, rows)
        self.vocab_start, self.vocab_end, self.vocab_size = start, end, vocab_size
        self.weight.weight_loader = self._load_weight

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor | Any) -> None:
        _check_rows("lm_head", loaded, self.vocab_size)
        n = self.vocab_end - self.vocab_start
        default_weight_loader(param.data[:n], loaded[self.vocab_start : self.vocab_end])
        param.data[n:] = 0
