"""Gemma 3 text models (Gemma team 2025), ``Gemma3ForCausalLM``, with Hugging Face module names.

Local sliding-window layers interleaved with global ones (``layer_types``, five local to one global
in the released models), each type with its own rotary frequencies (``rope_parameters`` per layer
type: local theta 10k, global 1M, possibly scaled); per-head q/k RMSNorm; Gemma's ``1 + w``
RMSNorm, applied before and after both attention and the MLP (four per layer); a GeGLU MLP (tanh
GELU); token embeddings scaled by ``sqrt(hidden_size)`` (rounded to the model dtype, as
transformers does); the softmax scale ``query_pre_attn_scalar ** -0.5``; a tied LM head; and
soft-capping of attention scores and final logits where the config sets
``attn_logit_softcapping`` / ``final_logit_softcapping``. Tensor parallelism splits heads,
channels and the vocabulary as in ``pdserve.models.llama``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pdserve.distributed import SINGLE_RANK, TpGroup
from pdserve.layers.activation import GeluAndMul
from pdserve.layers.embedding import VocabParallelEmbedding
from pdserve.layers.layernorm import GemmaRMSNorm
from pdserve.layers.rotary_embedding import get_rope
from pdserve.models.config_checks import layer_sliding_window
from pdserve.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM, LlamaMLP

if TYPE_CHECKING:
    from pdserve.engine.forward_batch import ForwardBatch


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, tp: TpGroup):
        super().__init__()
        options = AttentionOptions(
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            qk_norm=True,
            norm_class=GemmaRMSNorm,
            scaling=config.query_pre_attn_scalar**-0.5,
            logit_cap=config.attn_logit_softcapping or 0.0,
        )
        self.is_sliding = bool(layer_sliding_window(config, layer_id))
        self.self_attn = LlamaAttention(config, layer_id, options, tp)
        if config.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(
                f"hidden_activation {config.hidden_activation!r} is not supported (gelu_pytorch_tanh)"
            )
        self.mlp = LlamaMLP(config, tp, act_fn=GeluAndMul())
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self,
        rotary_emb: nn.Module,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` is the previous layer's MLP output before its residual add (the embeddings for
        the first layer, whose ``residual`` is None); returns this layer's, and the residual."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(rotary_emb, positions, hidden, forward_batch))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3TextModel(nn.Module):
    def __init__(self, config: Any, max_position: int, tp: TpGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.normalizer = config.hidden_size**0.5
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = config.head_dim
        self.rotary_local = get_rope(config, head_dim, max_position, "sliding_attention")
        self.rotary_global = get_rope(config, head_dim, max_position, "full_attention")

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.normalizer, dtype=hidden.dtype)
        residual = None
        for layer in self.layers:
            rotary = self.rotary_local if layer.is_sliding else self.rotary_global
            hidden, residual = layer(rotary, positions, hidden, residual, forward_batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Decoder + tied LM head (``LlamaForCausalLM``'s logits), soft-capped where the config says."""

    def __init__(self, config: Any, max_position: int, tp: TpGroup = SINGLE_RANK):
        super().__init__(config, max_position, tp)
        self.final_logit_cap = config.final_logit_softcapping or 0.0

    def build_model(self, config: Any, max_position: int, tp: TpGroup) -> nn.Module:
        return Gemma3TextModel(config, max_position, tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_logit_cap:
            logits = torch.tanh(logits / self.final_logit_cap) * self.final_logit_cap
        return logits
