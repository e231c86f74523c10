"""Speculative sampling's rejection rule: the verified token of a position whose draft token was
sampled from a draft distribution ``q``.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and Chen et
al. 2023 ("Accelerating Large Language Model Decoding with Speculative Sampling"): accept the
draft token ``x ~ q`` with probability ``min(1, p(x) / q(x))``; on rejection sample from
``norm(max(0, p - q))``. The token that comes out is distributed exactly as ``p``, the target's
distribution at that position. A position's outcome is written as one token: the draft token when
accepted, else the residual sample (which is never the draft token: a rejected ``x`` has
``p(x) < q(x)``), so the verify step keeps the longest prefix of positions whose token equals the
draft's, as it does for deterministic drafts (``pdserve.sampling.verify``).
"""

from __future__ import annotations

import torch

from pdserve.sampling.uniforms import uniforms

# A seeded row's two numbers come from a generator of its own step seed mixed with this constant, so
# they differ from the number its ordinary sample of the same step draws (and from any other step's).
_REJECTION_SALT = 0x2545F4914F6CDD1D


def rejection_sample(
    p: torch.Tensor, q: torch.Tensor, draft_ids: torch.Tensor, seeds: list[int | None]
) -> torch.Tensor:
    """The verified token of each row.

    Args:
        p: float32 ``[n, V]``: the target's distribution at each position (``target_probs``: after
            penalties, grammar, temperature and filters; rows sum to 1).
        q: float32 ``[n, V]``: the distribution each draft token was sampled from.
        draft_ids: int64 ``[n]``: the draft tokens (``q`` > 0 at each).
        seeds: per row its step seed (``SamplingBatchInfo.step_seeds``) or None (global RNG).

    Returns:
        int64 ``[n]``: the draft token where accepted, else a sample of ``norm(max(0, p - q))``.
    """
    u = uniforms([None if s is None else s ^ _REJECTION_SALT for s in seeds], p.device, count=2)
    index = draft_ids[:, None]
    accept = u[:, 0] * q.gather(1, index).squeeze(1) < p.gather(1, index).squeeze(1)
    residual = (p - q).clamp_min_(0.0)
    # p == q leaves no residual (and never rejects); keep the row defined all the same
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    cdf = residual.cumsum(dim=-1)
    picks = torch.searchsorted(cdf, u[:, 1:] * cdf[:, -1:], right=True).clamp_(max=p.shape[1] - 1)
    return torch.where(accept, draft_ids, picks.squeeze(1))
