"""The experts of one mixture-of-experts layer, held as stacked weights (Hugging Face transformers 5's
``experts.gate_up_proj`` / ``experts.down_proj``) and computed grouped by expert.

A token's ``k`` routed experts are ``k`` slots. The slots are sorted by expert, so each active expert
multiplies its tokens' rows in one GEMM (gate/up, the activation, down), and the weighted rows are
added into their tokens in expert order: each token's sum runs over its own experts in ascending
id, as Hugging Face's loop over experts adds them, whatever else is in the batch. On CPU each
expert's matrices are packed once at load for ``cpu_matmul`` (bfloat16, or quantized by the model's
linear method: int8, int4, w8a8, w4a8) and every active expert of a step runs in one C call
(``cpu_experts``), SiLU-and-mul in the gate/up matmul's epilogue; float32 experts (and other
activations) run one ``F.linear`` pair per expert, as Hugging Face's loop does. On CUDA the GEMMs
of all bfloat16 experts are one ``torch._grouped_mm`` each (CUTLASS grouped GEMM).

Under tensor parallelism every rank holds a slice of each expert's intermediate channels, under
expert parallelism whole experts (``pdserve.distributed.expert_parallel``); either way the output
is this rank's partial sum, which the caller all-reduces.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdserve.distributed import SINGLE_RANK, TpGroup, expert_shard
from pdserve.layers.activation import SiluAndMul
from pdserve.layers.linear import PackedWeight, checkpoint_shape, linear, prepack_weight
from pdserve.layers.moe.cpu_experts import CpuExperts, pack_bf16

# The checkpoint shard kinds ``weight_loader`` takes, with an expert id, or None for a stacked tensor
# of every expert: ``gate`` / ``up`` [I, H] and ``down`` [H, I] per expert (as models ship), or
# stacked ``gate_up`` / ``down``, in the checkpoint's ``layout``:
# - ``hf``: transformers 5's modules, ``gate_up`` [E, 2I, H] (gate rows, then up), ``down`` [E, H, I];
# - ``gpt_oss``: ``gate_up`` [E, H, 2I] with gate and up columns interleaved, ``down`` [E, I, H];
#   biases ``gate_up`` [E, 2I] (interleaved) and ``down`` [E, H].
LAYOUTS = ("hf", "gpt_oss")


class FusedMoE(nn.Module):
    """Experts ``[E_local]`` of a layer: ``forward(x, ids, weights)`` → this rank's partial output.

    Args:
        num_experts / hidden_size / intermediate_size: the whole layer's (``I`` per expert).
        activation: the gated activation of ``[gate | up]`` (``pdserve.layers.activation``).
        bias: the experts' projections have biases (gpt-oss).
        tp / expert_parallel: this rank's share (``expert_shard``).
        layout: how stacked checkpoint tensors are laid out (``LAYOUTS``).

    Attributes:
        gate_up_proj: ``[E_local, 2 * I_local, H]`` (gate rows, then up); down_proj ``[E_local, H,
            I_local]``; gate_up_proj_bias / down_proj_bias ``[E_local, 2 * I_local]`` / ``[E_local, H]``
            or None. The float weights are dropped once packed.
        quant_method: set by the loader for a quantized model (its ``pack`` packs each expert).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: nn.Module,
        bias: bool = False,
        tp: TpGroup = SINGLE_RANK,
        expert_parallel: bool = False,
        layout: str = "hf",
    ):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"unknown expert checkpoint layout {layout!r}")
        self.shard = shard = expert_shard(num_experts, intermediate_size, tp.size, tp.rank, expert_parallel)
        self.num_experts, self.intermediate_size, self.layout = num_experts, intermediate_size, layout
        local, channels = shard.num_experts, shard.num_channels
        self.gate_up_proj = _parameter(local, 2 * channels, hidden_size, loader=self.weight_loader)
        self.down_proj = _parameter(local, hidden_size, channels, loader=self.weight_loader)
        self.gate_up_proj_bias = _parameter(local, 2 * channels, loader=self.weight_loader) if bias else None
        self.down_proj_bias = _parameter(local, hidden_size, loader=self.weight_loader) if bias else None
        self.activation = activation
        self.zero_down_bias = not expert_parallel and not tp.is_driver  # the all-reduce adds it once
        self.quant_method = None
        self.packed: list[tuple[PackedWeight | None, PackedWeight | None]] | None = None
        self.fused_silu = False
        self.cpu_experts: CpuExperts | None = None
        self._filled: set[tuple[str, int, str]] = set()

    # ---- loading ---------------------------------------------------------------------------------
    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor | Any, shard: tuple[int | None, str]
    ) -> None:
        """Copy checkpoint shard ``shard = (expert or None, kind)`` (see ``LAYOUTS``) into ``param``:
        this rank's experts and channels only; another rank's expert is skipped.

        Raises:
            ValueError: a shape that does not fit the layer.
        """
        name = next(n for n, p in self.named_parameters(recurse=False) if p is param)
        expert, kind = shard
        start, local = self.shard.expert_start, self.shard.num_experts
        if expert is not None:
            if start <= expert < start + local:
                self._fill(name, expert - start, kind, loaded)
            return
        shape = checkpoint_shape(loaded)
        if shape[0] != self.num_experts:
            raise ValueError(
                f"stacked experts tensor for {name} has shape {shape}; expected {self.num_experts} experts"
            )
        stacked = loaded[start : start + local]
        if self.layout == "gpt_oss" and name.endswith("proj"):  # [E, in, out] → [E, out, in]
            stacked = stacked.transpose(1, 2)
        for e in range(local):
            if kind == "down":
                self._fill(name, e, "down", stacked[e])
            elif self.layout == "gpt_oss":  # gate, up interleaved
                self._fill(name, e, "gate", stacked[e][0::2])
                self._fill(name, e, "up", stacked[e][1::2])
            else:
                half = stacked.shape[1] // 2
                self._fill(name, e, "gate", stacked[e][:half])
                self._fill(name, e, "up", stacked[e][half:])

    def _fill(self, name: str, e: int, kind: str, full: torch.Tensor | Any) -> None:
        """Expert ``e``'s (local index) ``kind`` from its whole checkpoint matrix or bias ``full``."""
        param = getattr(self, name)
        shape = checkpoint_shape(full)
        start, channels = self.shard.channel_start, self.shard.num_channels
        if kind == "down":
            want = (param.shape[1], self.intermediate_size) if name == "down_proj" else tuple(param.shape[1:])
            if shape != want:
                raise ValueError(
                    f"checkpoint {kind} of expert {e} for {name} has shape {shape}; expected {want}"
                )
            part = full[:, start : start + channels] if name == "down_proj" else full[:]
            param.data[e].copy_(part)
            if name == "down_proj_bias" and self.zero_down_bias:
                param.data[e].zero_()
        else:
            if shape[0] != self.intermediate_size or shape[1:] != tuple(param.shape[2:]):
                raise ValueError(f"checkpoint {kind} of expert {e} for {name} has shape {shape}")
            offset = 0 if kind == "gate" else channels
            param.data[e, offset : offset + channels].copy_(full[start : start + channels])
        self._filled.add((name, e, kind))

    def missing_shards(self) -> list[str]:
        """The checkpoint values this rank's experts still lack (the loader reports them)."""
        kinds = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
        if self.gate_up_proj_bias is not None:
            kinds |= {"gate_up_proj_bias": ("gate", "up"), "down_proj_bias": ("down",)}
        start = self.shard.expert_start
        return [
            f"{name}[expert {start + e}].{kind}"
            for name, names in kinds.items()
            for e in range(self.shard.num_experts)
            for kind in names
            if (name, e, kind) not in self._filled
        ]

    def process_weights_after_loading(self) -> None:
        """Pack each expert's matrices: by the model's linear method when quantized, bfloat16 ones
        for the grouped kernel (``cpu_experts.pack_bf16``), else as ``prepack_weight`` packs a
        ``Linear``'s; gate/up in halves where SiLU-and-mul can run in the matmul's epilogue. Packed,
        the float weights are dropped. float32 experts stay unpacked (``F.linear``, as HF)."""
        w13, w2 = self.gate_up_proj.data, self.down_proj.data
        if self.quant_method is not None:
            pack = self.quant_method.pack
        elif w13.dtype == torch.bfloat16 and pack_bf16(w13[0]) is not None:
            pack = pack_bf16
        else:
            pack = prepack_weight
        packed = [(pack(w13[e]), pack(w2[e])) for e in range(len(w13))]
        if any(p13 is None or p2 is None for p13, p2 in packed):
            return  # float32, or a device our packed kernels do not serve
        self.fused_silu = isinstance(self.activation, SiluAndMul) and all(
            hasattr(p, "to_halves") for p, _ in packed
        )
        self.packed = [(p13.to_halves() if self.fused_silu else p13, p2) for p13, p2 in packed]
        self.gate_up_proj = self.down_proj = None
        if self.fused_silu:
            biases = [
                (_row(self.gate_up_proj_bias, e), _row(self.down_proj_bias, e)) for e in range(len(w13))
            ]
            self.cpu_experts = CpuExperts.build(self.packed, biases, self.shard.expert_start)

    # ---- compute ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]``, the routed experts ``ids`` (int64, global) and their ``weights``
        ``[T, k]`` → ``[T, H]`` in x's dtype: the sum over each token's experts held here, in
        ascending id, of ``weight * expert(x)``, each term and each partial sum rounded to x's
        dtype as Hugging Face's loop of ``index_add_`` calls rounds them (on CUDA the terms are
        added in one call, in float32, then rounded)."""
        if self.cpu_experts is not None:
            return self.cpu_experts(x, ids, weights)
        num_slots = ids.shape[1]
        local = ids.flatten() - self.shard.expert_start
        held = (local >= 0) & (local < self.shard.num_experts)
        key = torch.where(held, local, self.shard.num_experts)  # slots of other ranks' experts go last
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=self.shard.num_experts + 1)[:-1]
        order = order[: int(counts.sum())]
        tokens = order // num_slots
        out = torch.zeros_like(x)
        if not len(order):
            return out
        slot_weights = weights.flatten()[order, None]
        if x.is_cuda and x.dtype == torch.bfloat16:  # CUTLASS's grouped GEMM: bfloat16 only
            rows = self._grouped(x[tokens], counts) * slot_weights
            return out.index_add_(0, tokens, rows.to(x.dtype))
        start = 0
        for e, count in enumerate(counts.tolist()):  # CPU: one GEMM pair per active expert
            if count:
                span = slice(start, start + count)
                rows = self._expert(e, x[tokens[span]]) * slot_weights[span]
                out.index_add_(0, tokens[span], rows.to(x.dtype))
                start += count
        return out

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        b13, b2 = _row(self.gate_up_proj_bias, e), _row(self.down_proj_bias, e)
        if self.packed is None:
            return linear(self.activation(linear(x, self.gate_up_proj[e], b13)), self.down_proj[e], b2)
        p13, p2 = self.packed[e]
        hidden = p13.silu_and_mul(x, b13) if self.fused_silu else self.activation(p13.matmul(x, b13))
        return p2.matmul(hidden, b2)

    def _grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """CUDA: each projection of every expert as one grouped GEMM over the sorted rows."""
        offsets = counts.cumsum(0).to(torch.int32)
        hidden = torch._grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=offsets)
        if self.gate_up_proj_bias is not None:
            hidden = hidden + self.gate_up_proj_bias.repeat_interleave(counts, dim=0)
        out = torch._grouped_mm(self.activation(hidden), self.down_proj.transpose(1, 2), offs=offsets)
        if self.down_proj_bias is not None:
            out = out + self.down_proj_bias.repeat_interleave(counts, dim=0)
        return out


def _parameter(*shape: int, loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader
    return param


def _row(bias: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if bias is None else bias[e]
