"""``LoraSlots.add`` on its own: a batch mixing base tokens and several adapters (decode- and
prefill-sized) gets each token's delta ``(x @ A[slot]^T) @ B[slot]^T``, equal to a float64
per-token reference, in float32 and in bfloat16 activations; base tokens stay bit for bit."""

from __future__ import annotations

import pytest
import torch

from pdserve.lora.layer import BASE_SLOT, LoraBatch, LoraSlots, LoraState

SHARDS = [(0, 48), (48, 16), (64, 16)]  # a fused q/k/v-like layer
IN, RANK, SLOTS = 40, 8, 4


def filled(state: LoraState, gen: torch.Generator) -> tuple[LoraSlots, dict]:
    """Slots 0-2 hold random adapters (slot 1 of rank 4, not targeting shard 2); slot 3 is empty."""
    slots = LoraSlots(IN, SHARDS, SLOTS, RANK, state)
    weights = {}
    for slot, rank in ((0, RANK), (1, 4), (2, RANK)):
        for shard, (_, size) in enumerate(SHARDS):
            if slot == 1 and shard == 2:
                slots.write(slot, shard, None, None)
                continue
            a, b = torch.randn(rank, IN, generator=gen), torch.randn(size, rank, generator=gen)
            slots.write(slot, shard, a, b)
            weights[(slot, shard)] = (a, b)
    return slots, weights


@pytest.mark.parametrize("tokens", [8, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_matches_per_token_reference(tokens, dtype):
    gen = torch.Generator().manual_seed(tokens)
    state = LoraState()
    slots, weights = filled(state, gen)
    token_slots = torch.tensor([(BASE_SLOT, 0, 1, 2)[i % 4] for i in range(tokens)])
    token_slots[-1] = 3  # an empty slot: a zero delta
    x = torch.randn(tokens, IN, generator=gen).to(dtype)
    y = torch.randn(tokens, SHARDS[-1][0] + SHARDS[-1][1], generator=gen).to(dtype)
    want = y.double()
    for t, slot in enumerate(token_slots.tolist()):
        for shard, (offset, size) in enumerate(SHARDS):
            if (slot, shard) in weights:
                a, b = weights[(slot, shard)]
                want[t, offset : offset + size] += b.double() @ (a.double() @ x[t].double())
    state.batch = LoraBatch.of(token_slots)
    got = slots.add(x, y.clone())
    base = token_slots == BASE_SLOT
    assert torch.equal(got[base], y[base])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=tol, atol=tol)


def test_no_adapter_token_leaves_output_alone():
    state = LoraState()
    slots, _ = filled(state, torch.Generator().manual_seed(0))
    state.batch = LoraBatch.of(torch.full((5,), BASE_SLOT))
    assert state.batch is None
    y = torch.randn(5, 80)
    assert torch.equal(slots.add(torch.randn(5, IN), y.clone()), y)


def test_shards_must_tile_the_output():
    with pytest.raises(ValueError, match="tile"):
        LoraSlots(IN, [(0, 48), (64, 16)], SLOTS, RANK, LoraState())
