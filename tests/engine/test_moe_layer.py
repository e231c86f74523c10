"""The mixture-of-experts layer: routers equal transformers' own router modules; experts, in every
packed format the CPU kernels take, close to a float64 reference (float32 ones equal to HF's loop);
the grouped C kernel equal to the expert-by-expert path, bit for bit; the TP and EP shards of a
layer summing to the whole layer; the CUDA path's grouped GEMMs (run here on CPU) close to it."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter

from pdserve.distributed import TpGroup
from pdserve.layers.activation import ClampedSwiGLU, SiluAndMul
from pdserve.layers.moe.fused_moe import FusedMoE
from pdserve.layers.moe.router import RouterSpec, Scoring, TopKRouter
from pdserve.layers.quantization import get_linear_method
from tests.families import FAMILIES

E, H, C, K, T = 16, 64, 32, 4, 24  # experts, hidden, channels of an expert, experts a token, tokens
CONFIGS = {
    "qwen3_moe": FAMILIES["qwen3_moe"].make_config(
        300, hidden_size=H, num_experts=E, moe_intermediate_size=C
    ),
    "mixtral": FAMILIES["mixtral"].make_config(300, hidden_size=H, num_local_experts=E, intermediate_size=C),
    "gpt_oss": FAMILIES["gpt_oss"].make_config(300, hidden_size=H, num_local_experts=E, intermediate_size=C),
}
ROUTERS = {
    "qwen3_moe": (Qwen3MoeTopKRouter, RouterSpec(Scoring.SOFTMAX_TOPK, renormalize=True), False),
    "mixtral": (MixtralTopKRouter, RouterSpec(Scoring.SOFTMAX_TOPK, float32_weights=True), False),
    "gpt_oss": (GptOssTopKRouter, RouterSpec(Scoring.TOPK_SOFTMAX), True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(ROUTERS))
def test_router_equals_transformers(family, dtype):
    hf_class, spec, bias = ROUTERS[family]
    hf = hf_class(CONFIGS[family]).to(dtype)
    torch.manual_seed(0)
    for p in hf.parameters():
        p.data.normal_(0, 0.5)
    ours = TopKRouter(H, hf.weight.shape[0], hf.top_k, spec, bias=bias).to(dtype)
    ours.load_state_dict(hf.state_dict())
    ours.process_weights_after_loading()
    x = torch.randn(T, H).to(dtype)
    weights, ids = ours(x)
    _, hf_weights, hf_ids = hf(x)
    assert torch.equal(ids, hf_ids)
    assert weights.dtype == hf_weights.dtype and torch.equal(weights, hf_weights)


def experts(dtype=torch.float32, activation=None, **kwargs) -> FusedMoE:
    """A layer with seeded random experts (every rank of a split draws the same whole layer)."""
    torch.manual_seed(1)
    full_up, full_down = torch.randn(E, 2 * C, H) * 0.1, torch.randn(E, H, C) * 0.1
    torch.set_default_dtype(dtype)
    try:
        layer = FusedMoE(E, H, C, activation or SiluAndMul(), **kwargs)
    finally:
        torch.set_default_dtype(torch.float32)
    layer.weight_loader(layer.gate_up_proj, full_up.to(dtype), (None, "gate_up"))
    layer.weight_loader(layer.down_proj, full_down.to(dtype), (None, "down"))
    return layer


def routing(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return torch.randn(T, H, generator=gen), ids, torch.rand(T, K, generator=gen)


def reference(layer_up: torch.Tensor, layer_down: torch.Tensor, x, ids, weights) -> torch.Tensor:
    """The float64 sum over each token's experts of weight * down(silu(gate x) * up x)."""
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            gate, up = (layer_up[ids[t, j]].double() @ x[t].double()).chunk(2)
            out[t] += weights[t, j] * (layer_down[ids[t, j]].double() @ (torch.nn.functional.silu(gate) * up))
    return out


def test_float32_experts_match_transformers_loop():
    layer = experts()
    hf = Qwen3MoeExperts(CONFIGS["qwen3_moe"])
    hf.gate_up_proj.data.copy_(layer.gate_up_proj.data)
    hf.down_proj.data.copy_(layer.down_proj.data)
    layer.process_weights_after_loading()
    assert layer.cpu_experts is None  # float32: F.linear per expert, as HF
    x, ids, weights = routing()
    # the same ops; MKL's sums may round by a unit in the last place where its blocking differs
    torch.testing.assert_close(layer(x, ids, weights), hf(x, ids, weights), rtol=1e-6, atol=1e-7)


# (dtype, quantization) → bound on |error| / max |reference|
FORMATS = {
    (torch.bfloat16, None): 0.02,
    (torch.float32, "int8_weight_only"): 0.02,
    (torch.float32, "int4_weight_only"): 0.2,
    (torch.float32, "w4a8"): 0.2,
    (torch.bfloat16, "w8a8_int8"): 0.04,
}


@pytest.mark.parametrize(("dtype", "quantization"), sorted(FORMATS, key=str))
def test_packed_formats_run_grouped_and_equal_the_expert_by_expert_path(dtype, quantization):
    layer = experts(dtype)
    expected = reference(layer.gate_up_proj.data, layer.down_proj.data, *routing())
    layer.quant_method = get_linear_method(quantization)
    layer.process_weights_after_loading()
    assert layer.cpu_experts is not None
    x, ids, weights = routing()
    x = x.to(dtype)
    grouped = layer(x, ids, weights)
    error = (grouped.double() - expected).abs().max() / expected.abs().max()
    assert error < FORMATS[dtype, quantization], f"error {error:.3g}"
    layer.cpu_experts = None  # the Python path over the same packed weights
    one_by_one = layer(x, ids, weights)
    if dtype == torch.bfloat16:  # the same roundings, in the same order
        assert torch.equal(grouped, one_by_one)
    else:  # float32 sums: the kernel may fuse the multiply-adds of the combine
        torch.testing.assert_close(grouped, one_by_one, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_shards_of_two_ranks_sum_to_the_layer(expert_parallel):
    """EP: ranks hold experts 0-7 and 8-15; TP: every expert's channels 0-15 and 16-31."""
    whole = experts()
    whole.process_weights_after_loading()
    x, ids, weights = routing()
    parts = [experts(tp=TpGroup(rank, 2), expert_parallel=expert_parallel) for rank in (0, 1)]
    shard = parts[1].shard
    assert (shard.expert_start, shard.num_experts, shard.channel_start, shard.num_channels) == (
        (8, 8, 0, C) if expert_parallel else (0, E, C // 2, C // 2)
    )
    assert all(not part.missing_shards() for part in parts)
    total = sum(part(x, ids, weights) for part in parts)
    torch.testing.assert_close(total, whole(x, ids, weights), rtol=1e-5, atol=1e-6)


def test_grouped_gemm_path():
    """The CUDA path (``torch._grouped_mm`` over the sorted rows), run on CPU, gives the expert-by-expert
    path's outputs (the GEMMs' summation order apart)."""
    layer = experts(activation=ClampedSwiGLU(1.702, 7.0), bias=True)
    layer.weight_loader(layer.gate_up_proj_bias, torch.randn(E, 2 * C), (None, "gate_up"))
    layer.weight_loader(layer.down_proj_bias, torch.randn(E, H), (None, "down"))
    x, ids, weights = routing()
    one_by_one = layer(x, ids, weights)
    key = torch.where(ids.flatten() >= 0, ids.flatten(), E)
    order = torch.argsort(key, stable=True)
    rows = layer._grouped(x[order // K], torch.bincount(key, minlength=E))
    grouped = torch.zeros_like(x).index_add_(0, order // K, rows * weights.flatten()[order, None])
    torch.testing.assert_close(grouped, one_by_one, rtol=1e-4, atol=1e-5)


def test_gpt_oss_layout_loads_as_transformers_computes():
    """gpt-oss's stacked, transposed, interleaved gate/up (with biases) give transformers' outputs."""
    config = CONFIGS["gpt_oss"]
    hf = GptOssExperts(config)
    torch.manual_seed(3)
    for p in hf.parameters():
        p.data.normal_(0, 0.2)
    layer = FusedMoE(
        E, H, C, ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit), bias=True, layout="gpt_oss"
    )
    for name, param in hf.named_parameters():
        kind = "down" if name.startswith("down") else "gate_up"
        layer.weight_loader(getattr(layer, name), param.data, (None, kind))
    assert not layer.missing_shards()
    x, ids, weights = routing()
    torch.testing.assert_close(layer(x, ids, weights), hf(x, ids, weights), rtol=1e-5, atol=1e-5)


def test_missing_experts_are_named():
    layer = FusedMoE(E, H, C, SiluAndMul())
    layer.weight_loader(layer.gate_up_proj, torch.zeros(C, H), (3, "gate"))
    missing = layer.missing_shards()
    assert "gate_up_proj[expert 3].up" in missing and "gate_up_proj[expert 3].gate" not in missing
    assert len(missing) == 3 * E - 1
