"""The BGMV kernel (``lora/bgmv.py``, ``c-kernels/lora.c``) on every CPU kernel variant this machine
runs, against the torch computation of the same delta (float32 matmuls per adapter group, as
``LoraSlots.add``'s torch path does): random shapes, adapters of lower rank than the buffers, base
tokens mixed in, several slots, float32 and bfloat16 ``x`` / ``y``."""

from __future__ import annotations

import pytest
import torch

from pdserve.layers.native import forced_variant, runnable_variants
from pdserve.lora.bgmv import Bgmv, load_bgmv
from pdserve.lora.layer import BASE_SLOT, LoraBatch, LoraSlots, LoraState

DTYPES = [torch.float32, torch.bfloat16]


def random_layer(gen: torch.Generator, in_features: int, sizes: list[int], rank: int) -> LoraSlots:
    """Five slots: 0-3 hold adapters of ranks ``rank``, ``rank // 2``, 1 and ``rank`` (slot 3 not
    targeting the last shard), slot 4 is empty."""
    shards = [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]
    slots = LoraSlots(in_features, shards, 5, rank, LoraState())
    for slot, r in enumerate((rank, rank // 2, 1, rank)):
        for shard, size in enumerate(sizes):
            if slot == 3 and shard == len(sizes) - 1:
                continue
            slots.write(
                slot, shard, torch.randn(r, in_features, generator=gen), torch.randn(size, r, generator=gen)
            )
    return slots


def torch_delta(slots: LoraSlots, x: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """float32 ``[T, out]``: per adapter group, ``(x @ A^T) @ B^T`` shard by shard, as torch matmuls."""
    r = slots.rank
    delta = torch.zeros(x.shape[0], sum(size for _, size in slots.shards))
    for slot in set(token_slots.tolist()) - {BASE_SLOT}:
        index = (token_slots == slot).nonzero().squeeze(1)
        shrunk = x.float()[index] @ slots.a[slot]
        delta[index] = torch.cat([shrunk[:, s * r : (s + 1) * r] @ b[slot] for s, b in enumerate(slots.b)], 1)
    return delta


@pytest.mark.parametrize("variant", runnable_variants())
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("y_dtype", DTYPES)
@pytest.mark.parametrize("case", range(3))
def test_kernel_matches_torch_delta(variant, x_dtype, y_dtype, case):
    gen = torch.Generator().manual_seed(case)
    in_features, rank = (24, 200, 576)[case], (8, 16, 4)[case]
    sizes = [(48, 16, 16), (130,), (200, 67)][case]  # partial and several column blocks
    tokens = (5, 9, 300)[case]  # 300: enough work for the parallel loop
    slots = random_layer(gen, in_features, list(sizes), rank)
    token_slots = torch.randint(BASE_SLOT, 5, (tokens,), generator=gen)
    token_slots[:2] = torch.tensor([BASE_SLOT, 3])
    x = torch.randn(tokens, in_features + 3, generator=gen).to(x_dtype)[:, 1:-2]  # a strided view
    y = torch.randn(tokens, sum(sizes), generator=gen).to(y_dtype)
    order = LoraBatch.of(token_slots).order  # grouped by slot; case 1: the tokens as they come
    if case == 1:
        order = (token_slots != BASE_SLOT).nonzero().squeeze(1)
    with forced_variant(variant):
        bgmv = load_bgmv()
        assert bgmv is not None and Bgmv.supports(x, y)
        got = y.clone()
        bgmv.add_(x, got, token_slots, order, slots.weights)
    want = (y.float() + torch_delta(slots, x, token_slots)).to(y_dtype)
    base = token_slots == BASE_SLOT
    assert torch.equal(got[base], y[base])
    if y_dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    else:  # one bfloat16 rounding step where the float32 sums round differently
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("variant", runnable_variants())
def test_a_token_delta_does_not_depend_on_its_batch(variant):
    """Each token's row is bit for bit the same alone as in a batch of 20 tokens of its adapter and
    others (docs/lora.md "Limits": determinism)."""
    gen = torch.Generator().manual_seed(3)
    slots = random_layer(gen, 96, [80, 40], 8)
    token_slots = torch.tensor([0] * 12 + [1, 2, 0, BASE_SLOT, 3, 0, 2, 4])
    x = torch.randn(20, 96, generator=gen)
    y = torch.randn(20, 120, generator=gen).bfloat16()
    with forced_variant(variant):
        bgmv = load_bgmv()
        together = y.clone()
        bgmv.add_(x, together, token_slots, LoraBatch.of(token_slots).order, slots.weights)
        for t in range(20):
            alone = y[t : t + 1].clone()
            order = torch.tensor([] if token_slots[t] == BASE_SLOT else [0], dtype=torch.int64)
            bgmv.add_(x[t : t + 1], alone, token_slots[t : t + 1], order, slots.weights)
            assert torch.equal(alone[0], together[t])


def test_torch_path_where_the_kernel_cannot_run():
    """A ``y`` without unit stride in its rows goes through the torch ops, to the same values."""
    gen = torch.Generator().manual_seed(7)
    slots = random_layer(gen, 32, [16, 8], 4)
    token_slots = torch.tensor([BASE_SLOT, 0, 1, 2, 3, 4, 0])
    slots.state.batch = LoraBatch.of(token_slots)
    x = torch.randn(7, 32, generator=gen)
    y = torch.randn(7, 48, generator=gen)[:, ::2]  # added to in place: a view, never a dense copy
    assert not Bgmv.supports(x, y)
    want = y + torch_delta(slots, x, token_slots)
    torch.testing.assert_close(slots.add(x, y), want, rtol=1e-5, atol=1e-5)
