"""A step's decoder layers in one C call (``pdserve/c-kernels/decoder.c``), for Llama-family
models whose linear layers all run on ``cpu_matmul``'s packed weights (the quantized methods).

Through the modules, a batch-1 decode step of SmolLM2 (30 layers) makes ~300 kernel calls from
Python, each with its argument checks, tensor allocations and ctypes conversions; those fixed
costs were as large as the step's weight reads (~10 ms of a ~25 ms step here). ``CpuDecoder``
builds every layer's parameters (weight pointers, formats, norms, KV pages) once, so the layers of
a step are one ``decoder_layers`` call that runs the same kernels in the same order (the same
results as the modules' path, which the tests check). It serves every batch whose attention the
backend runs on its C kernel (a row per token: decodes, extends, verifying requests and mixed
batches alike; each layer with its sliding window).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import torch

from pdserve.layers.attention.score_mods import needs_score_mods
from pdserve.layers.cpu_matmul import FORMATS, NIBBLE_PLANES, MatmulWeight
from pdserve.layers.native import kernel_library, selected_variant

if TYPE_CHECKING:
    from pdserve.engine.forward_batch import ForwardBatch

_P, _I, _C, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class LinearStruct(ctypes.Structure):
    _fields_ = [("kernel", _C), ("format", _C), ("planes", _C), ("N", _C), ("K", _C), ("halves", _C),
                ("data", _P), ("scale", _P), ("mins", _P), ("bias", _P)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", LinearStruct), ("o", LinearStruct),
                ("gate_up", LinearStruct), ("down", LinearStruct), ("k_pages", _P), ("v_pages", _P),
                ("window", _I)]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [("T", _C), ("bf16", _C), ("kv_bf16", _C), ("hidden", _C), ("num_heads", _C),
                ("num_kv_heads", _C), ("head_dim", _C), ("intermediate", _C), ("threads", _C),
                ("max_pages", _I), ("page_size", _I), ("page_stride", _I), ("eps", _F), ("scale", _F),
                ("cos_sin", _P), ("positions", _P), ("loc", _P), ("page_table", _P), ("row_req", _P),
                ("seq_lens", _P)]  # fmt: skip


def _linear(module: Any, keep: list) -> LinearStruct:
    return linear_struct(module.packed, module.bias, keep)


def linear_struct(packed: MatmulWeight, bias: torch.Tensor | None, keep: list) -> LinearStruct:
    """decoder.c's ``Linear`` (``linear.h``) of a packed weight and its bias (a float32 copy of which
    goes into ``keep``, to live as long as the struct)."""
    bias = None if bias is None else bias.detach().float().contiguous()
    keep.append(bias)
    ptr = lambda t: None if t is None else t.data_ptr()
    # decoder.c's Linear.kernel: 1 matmul_w8a8, 2 matmul_w4a8 (NIBBLE_PLANES), 0 matmul_float (FORMATS)
    kernel = 1 if packed.format == "w8a8" else 2 if packed.format in NIBBLE_PLANES else 0
    return LinearStruct(
        kernel, FORMATS.get(packed.format, 0), NIBBLE_PLANES.get(packed.format, 0), packed.out_features,
        packed.in_features, packed.halves, ptr(packed.data), ptr(packed.scale), ptr(packed.mins), ptr(bias),
    )  # fmt: skip


class CpuDecoder:
    """The decoder layers of a ``LlamaModel`` as one C call per decode step.

    Build with ``CpuDecoder.build(model)`` (None where it does not apply); ``takes(fb)`` says whether
    a batch is one it runs; ``__call__(hidden, positions, fb)`` returns ``(hidden, residual)`` as the
    layers' loop would, for the model's final norm.
    """

    def __init__(self, model: Any, lib: ctypes.CDLL):
        self._fn = lib.decoder_layers
        self._fn.restype, self._fn.argtypes = _C, [_P, _C, _P, _P, _P]
        first = model.layers[0]
        attn = first.self_attn
        self.dtype = first.input_layernorm.weight.dtype
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden = first.input_layernorm.weight.shape[0]
        self.intermediate = first.mlp.down_proj.packed.in_features
        self.eps, self.scale = first.input_layernorm.eps, attn.attn.scaling
        self.rotary = model.rotary_emb
        self._keep: list = []
        self._layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            self._layers[i] = _Layer(
                layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                _linear(attn.qkv_proj, self._keep), _linear(attn.o_proj, self._keep),
                _linear(mlp.gate_up_proj, self._keep), _linear(mlp.down_proj, self._keep),
                window=attn.attn.sliding_window,
            )  # fmt: skip
        self._pool_ptr = None

    @classmethod
    def build(cls, model: Any) -> CpuDecoder | None:
        """The fused decoder of ``model`` (a ``LlamaModel`` whose weights are processed), or None when
        not every layer qualifies: CPU kernels on, float32 / bfloat16 activations, no q/k norm, no
        soft-capping or sinks (``score_mods``), a dense MLP, and every linear layer a ``MatmulWeight``
        (gate/up in halves, for SiLU-and-mul)."""
        variant = selected_variant()
        if variant is None or not len(model.layers):
            return None
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not hasattr(mlp, "gate_up_proj"):  # a mixture-of-experts layer
                return None
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if attn.qk_norm or needs_score_mods(attn.attn):
                return None
            if not all(isinstance(m.packed, MatmulWeight) for m in linears):
                return None
            if not mlp.gate_up_proj.packed.halves or layer.input_layernorm.weight.device.type != "cpu":
                return None
            if layer.input_layernorm.weight.dtype not in (torch.float32, torch.bfloat16):
                return None
        return cls(model, kernel_library(variant))

    def takes(self, fb: ForwardBatch) -> bool:
        """Whether the backend runs all of ``fb``'s attention on its C kernel (a row per token) over
        one pool (not an ``SWAKVPool``, whose local layers read pages of their own), and no token of
        ``fb`` has a LoRA adapter (those batches run the modules, which add the deltas)."""
        kernel_rows = getattr(fb.attn_backend, "kernel_rows", None) is not None
        return kernel_rows and fb.swa_out_cache_loc is None and fb.lora_slots is None

    def __call__(
        self, hidden: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pool = fb.token_to_kv_pool
        if self._pool_ptr != pool.kv_data.data_ptr():  # the pool's pages, once per pool
            for i in range(len(self._layers)):
                k_pages, v_pages = pool.kv_pages(i)
                self._layers[i].k_pages, self._layers[i].v_pages = k_pages.data_ptr(), v_pages.data_ptr()
            self._pool_ptr = pool.kv_data.data_ptr()
        rows = fb.attn_backend.kernel_rows
        row_req = None if rows.row_req is None else rows.row_req.data_ptr()
        hidden = hidden.contiguous()
        residual = torch.empty_like(hidden)
        positions, loc = positions.contiguous(), fb.out_cache_loc.contiguous()
        step = _Step(
            hidden.shape[0], hidden.dtype == torch.bfloat16, pool.dtype == torch.bfloat16, self.hidden,
            self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate, torch.get_num_threads(),
            rows.page_table.shape[1], pool.page_size, pool.page_stride, self.eps, self.scale,
            self.rotary.cos_sin_cache.data_ptr(), positions.data_ptr(), loc.data_ptr(),
            rows.page_table.data_ptr(), row_req, rows.seq_lens.data_ptr(),
        )  # fmt: skip
        if self._fn(
            self._layers, len(self._layers), ctypes.byref(step), hidden.data_ptr(), residual.data_ptr()
        ):
            raise MemoryError("decoder_layers: out of memory for a step's scratch buffers")
        return hidden, residual
