"""The draft tokens of a verify batch, row by row, as the sampler compares them
(speculative decoding; see ``pdserve.sampling.verify``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class DraftRows:
    """The draft tokens of a verify batch, per logits row (``N`` rows).

    Attributes:
        token_ids: int64 ``[N]``: the draft token each row's sample is compared with; -1 for a
            request's last row (its bonus position) and the row of a request without drafts.
        prob_rows: int64 ``[M]``: the rows whose draft token was sampled from a distribution ``q``,
            or None when every draft is deterministic.
        probs: float32 ``[M, V]``: ``q`` of those rows.
    """

    token_ids: torch.Tensor
    prob_rows: torch.Tensor | None = None
    probs: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        drafts: Sequence[Sequence[int]],
        probs: Sequence[torch.Tensor | None] | None = None,
        device: torch.device | str = "cpu",
    ) -> DraftRows:
        """From each request's drafts (``k_i`` ids, possibly none) and, where sampled, their ``q``
        (float32 ``[>= k_i, V]``, row ``j`` the distribution ``d_j`` came from)."""
        ids = [t for d in drafts for t in (*d, -1)]
        token_ids = torch.tensor(ids, dtype=torch.int64, device=device)
        rows, qs, start = [], [], 0
        for i, d in enumerate(drafts):
            if probs is not None and probs[i] is not None and d:
                rows += range(start, start + len(d))
                qs.append(probs[i][: len(d)].to(device, torch.float32))
            start += len(d) + 1
        if not rows:
            return cls(token_ids)
        return cls(token_ids, torch.tensor(rows, dtype=torch.int64, device=device), torch.cat(qs))

    def select(self, rows: Sequence[int]) -> DraftRows:
        """The rows ``rows`` (in that order) alone: a sub-batch's draft rows, its ``q`` rows kept."""
        token_ids = self.token_ids[torch.tensor(list(rows), dtype=torch.int64, device=self.token_ids.device)]
        if self.prob_rows is None:
            return DraftRows(token_ids)
        where = {r: j for j, r in enumerate(self.prob_rows.tolist())}
        kept = [(new, where[r]) for new, r in enumerate(rows) if r in where]
        if not kept:
            return DraftRows(token_ids)
        device = self.prob_rows.device
        new_rows = torch.tensor([new for new, _ in kept], dtype=torch.int64, device=device)
        return DraftRows(token_ids, new_rows, self.probs[torch.tensor([j for _, j in kept], device=device)])
