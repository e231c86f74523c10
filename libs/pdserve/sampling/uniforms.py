"""Per-row uniform random numbers: from a stateless generator where the row is seeded."""

from __future__ import annotations

import torch


def uniforms(seeds: list[int | None], device: torch.device | str, count: int = 1) -> torch.Tensor:
    """U[0, 1) float32, ``count`` per row (``[n]`` for one, else ``[n, count]``): from a generator
    seeded with the row's seed (``SamplingBatchInfo.step_seeds``), else the global RNG, so a seeded
    row's numbers depend on its seed alone."""
    uniform = torch.rand(len(seeds), count, device=device)
    for i, seed in enumerate(seeds):
        if seed is not None:
            generator = torch.Generator(device=device).manual_seed(seed)
            uniform[i] = torch.rand(count, generator=generator, device=device)
    return uniform[:, 0] if count == 1 else uniform
