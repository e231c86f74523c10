"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral), with Hugging Face module and parameter names.

Touvron et al. 2023: pre-norm RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP.
q/k/v and gate/up are fused into one matmul each; ``packed_modules_mapping`` tells the loader
which checkpoint matrices go where. Qwen2 and Qwen3 subclass this with their attention options,
Mixtral and Qwen3-MoE with a mixture-of-experts MLP (``make_mlp``). Layers the config marks as
sliding-window attend their window only (Mistral; ``config_checks.layer_sliding_window``).

Under tensor parallelism (``tp``, ``pdserve.layers.parallel_linear``) each rank holds its attention
heads (q/k/v column-parallel, ``o_proj`` row-parallel), its intermediate channels (gate/up
column-parallel, ``down_proj`` row-parallel) and its vocabulary rows (embedding and LM head): two
all-reduces per layer, one for the embedding, and an all-gather of the logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pdserve.distributed import SINGLE_RANK, TpGroup, head_shard, split_range
from pdserve.layers.activation import SiluAndMul
from pdserve.layers.cpu_decoder import CpuDecoder
from pdserve.layers.cpu_gemm import PanelWeight
from pdserve.layers.cpu_matmul import MatmulWeight
from pdserve.layers.embedding import VocabParallelEmbedding
from pdserve.layers.layernorm import RMSNorm
from pdserve.layers.linear import (
    Linear,
    PackedWeight,
    checkpoint_shape,
    default_weight_loader,
    linear,
    prepack_weight,
)
from pdserve.layers.parallel_linear import (
    ParallelLMHead,
    RowParallelLinear,
    gate_up_parallel_linear,
    qkv_parallel_linear,
)
from pdserve.layers.radix_attention import RadixAttention
from pdserve.layers.rotary_embedding import RotaryEmbedding, get_rope
from pdserve.models.config_checks import layer_sliding_window

if TYPE_CHECKING:
    from pdserve.engine.forward_batch import ForwardBatch


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """Where attention variants of the family differ: projection biases, per-head q/k RMSNorm (of
    ``norm_class``: Gemma's is ``1 + w``), the softmax scale (default ``head_dim ** -0.5``), score
    soft-capping, and attention sinks (gpt-oss: ``self_attn.sinks``, one logit per query head)."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norm_class: type[RMSNorm] = RMSNorm
    scaling: float | None = None
    logit_cap: float = 0.0
    sinks: bool = False


class LlamaAttention(nn.Module):
    """Attention over this rank's heads: ``num_heads`` / ``num_kv_heads`` are the rank's own."""

    def __init__(self, config: Any, layer_id: int, options: AttentionOptions, tp: TpGroup):
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        shard = head_shard(total_heads, total_kv_heads, tp.size, tp.rank)
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = qkv_parallel_linear(
            config.hidden_size, self.head_dim, total_heads, total_kv_heads, shard, options.qkv_bias
        )
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim,
            config.hidden_size,
            options.o_bias,
            tp,
            input_start=shard.q_start * self.head_dim,
            local_in=self.q_size,
        )
        if options.qk_norm:
            self.q_norm = options.norm_class(self.head_dim, config.rms_norm_eps)
            self.k_norm = options.norm_class(self.head_dim, config.rms_norm_eps)
        self.qk_norm = options.qk_norm
        if options.sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
            self.heads = (shard.q_start, total_heads)
        self.attn = RadixAttention(
            self.num_heads,
            self.head_dim,
            options.scaling or self.head_dim**-0.5,
            self.num_kv_heads,
            layer_id,
            sliding_window=layer_sliding_window(config, layer_id),
            logit_cap=options.logit_cap,
        )

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor | Any) -> None:
        start, total = self.heads
        if checkpoint_shape(loaded) != (total,):
            raise ValueError(f"checkpoint sinks of shape {checkpoint_shape(loaded)}; expected ({total},)")
        default_weight_loader(param, loaded[start : start + self.num_heads])

    def process_weights_after_loading(self) -> None:
        if hasattr(self, "sinks"):  # the backend reads them from the attention layer
            self.attn.sinks = self.sinks.data

    def forward(
        self,
        rotary_emb: RotaryEmbedding,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(-1, self.q_size)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(-1, self.kv_size)
        q, k = rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, forward_batch))


class LlamaMLP(nn.Module):
    """The gated MLP: SwiGLU, or the gated activation ``act_fn`` (Gemma's GeGLU)."""

    def __init__(self, config: Any, tp: TpGroup, act_fn: nn.Module | None = None):
        super().__init__()
        if act_fn is None and config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (silu only)")
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        self.gate_up_proj = gate_up_parallel_linear(config.hidden_size, size, bias, tp)
        start, local = split_range(size, tp.size, tp.rank)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias, tp, start, local)
        self.act_fn = act_fn or SiluAndMul()
        self.fused_act: PanelWeight | MatmulWeight | None = None

    def process_weights_after_loading(self) -> None:
        """Where our CPU matmuls run gate/up (any format), repack it so SiLU-and-mul happens
        in its epilogue (``fused_act``; the layer's own ``forward`` still gives ``[gate | up]``)."""
        gate_up = self.gate_up_proj
        if isinstance(self.act_fn, SiluAndMul) and hasattr(
            gate_up.packed, "to_halves"
        ):  # PanelWeight, MatmulWeight
            gate_up.packed = self.fused_act = gate_up.packed.to_halves()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = self.gate_up_proj.lora
        if self.fused_act is not None and (lora is None or not lora.active):  # LoRA needs [gate | up]
            return self.down_proj(self.fused_act.silu_and_mul(x, self.gate_up_proj.bias))
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


MakeMlp = Callable[[Any, int, TpGroup], nn.Module]  # (config, layer_id, tp) -> the layer's MLP


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, options: AttentionOptions, tp: TpGroup, make_mlp: MakeMlp):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, options, tp)
        self.mlp = make_mlp(config, layer_id, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        rotary_emb: RotaryEmbedding,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rotary_emb, positions, hidden, forward_batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self, config: Any, max_position: int, options: AttentionOptions, tp: TpGroup, make_mlp: MakeMlp
    ):
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = get_rope(config, head_dim, max_position)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, options, tp, make_mlp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tp = tp
        self.cpu_decoder: CpuDecoder | None = None

    def process_weights_after_loading(self) -> None:
        """Where every layer runs on ``cpu_matmul``'s packed weights, steps run the layers in one C
        call (``CpuDecoder``); None otherwise, and under TP (the C call has no collectives)."""
        self.cpu_decoder = CpuDecoder.build(self) if self.tp.size == 1 else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.cpu_decoder is not None and self.cpu_decoder.takes(forward_batch):
            hidden, residual = self.cpu_decoder(hidden, positions, forward_batch)
        else:
            residual = None
            for layer in self.layers:
                hidden, residual = layer(self.rotary_emb, positions, hidden, residual, forward_batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns final hidden states ``[T, hidden]``; ``compute_logits``
    turns selected rows into logits ``[N, vocab]``, every rank's vocabulary slice gathered under TP:
    float32 from a packed CPU LM head (the kernels' float32 sums: rounded to bfloat16, logits near 16
    lie 0.0625-0.125 apart, near-ties become ties and greedy decoding takes the lower token id),
    else in the model's dtype (the sampler upcasts when it needs float32). Tied embeddings share one
    parameter."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config: Any, max_position: int, tp: TpGroup = SINGLE_RANK):
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = self.build_model(config, max_position, tp)
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        self.lm_head_packed: PackedWeight | None = None

    @staticmethod
    def attention_options(config: Any) -> AttentionOptions:
        bias = getattr(config, "attention_bias", False)
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    def build_model(self, config: Any, max_position: int, tp: TpGroup) -> nn.Module:
        """The decoder (``model``): ``forward(input_ids, positions, forward_batch)`` → final hidden states."""
        return LlamaModel(config, max_position, self.attention_options(config), tp, self.make_mlp)

    def make_mlp(self, config: Any, layer_id: int, tp: TpGroup) -> nn.Module:
        """Layer ``layer_id``'s MLP: dense SwiGLU here; the MoE families override it."""
        return LlamaMLP(config, tp)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        return self.model(input_ids, positions, forward_batch)

    def process_weights_after_loading(self) -> None:
        """Pack the LM head (an untied one packed itself already; a tied one is the embedding)."""
        head = self.lm_head
        self.lm_head_packed = head.packed if isinstance(head, Linear) else prepack_weight(head.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.lm_head.weight, None, self.lm_head_packed, torch.float32)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits)[:, : self.config.vocab_size]


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral (Jiang et al. 2023): Llama with GQA and, where its config sets ``sliding_window``,
    sliding-window attention in every layer."""
