"""Prompt logprobs: the log-probability of each prompt token given the tokens before it, computed
from the logits an extend already makes (vLLM's ``prompt_logprobs``; what OpenAI's legacy ``echo``
with ``logprobs`` returns, and what lm-evaluation-harness scores a model by).

A request that asks for them has logits at every position of its chunk (``ForwardBatch.logits_lens``
is its extend length, so ``logits_index`` covers the chunk), not only at its last one. The logits at
position ``p`` score prompt token ``p + 1``: a chunk of positions ``[s, s + n)`` scores the tokens
``[s + 1, s + n]`` that are prompt tokens, so a prompt's chunks together score tokens
``1 .. L - 1`` (token 0 has nothing before it), and a last chunk's last position samples the first
output token as always. A scoring request samples from its last logits row only; any other request
from its rows as it would without scoring requests beside it (``sample_rows``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# One prompt token's (token id, logprob, [(top token id, logprob), ...], rank): its rank is 1 + the
# tokens more likely than it (vLLM's), whether or not it is among the top ones.
PromptLogprob = tuple[int, float, list[tuple[int, float]], int]


def chunk_targets(prompt: list[int], start: int, length: int) -> list[int]:
    """The prompt tokens scored by a chunk of ``length`` positions from ``start`` of ``prompt``."""
    return prompt[start + 1 : min(start + length + 1, len(prompt))]


@dataclass(slots=True)
class PromptLogprobRows:
    """Which logits rows of a batch score which prompt tokens, per request of the batch.

    Attributes:
        logits_lens: ``[B]``: logits rows of each request (``ForwardBatch.logits_lens``): its extend
            length where it scores its prompt; else what it has anyway (1, or ``k + 1`` for a
            request verifying ``k`` draft tokens).
        targets: ``[B]`` lists: the prompt tokens request ``b``'s first ``len(targets[b])`` logits
            rows score (empty for a request that scores none).
        top_nums: ``[B]``: the top alternatives a scoring request wants per prompt token (0..20);
            None for a request that does not score its prompt.
    """

    logits_lens: list[int]
    targets: list[list[int]]
    top_nums: list[int | None]

    @property
    def num_prompt_only_rows(self) -> int:
        """Logits rows that only score the prompt: a scoring request's rows but its last."""
        return sum(n - 1 for n, top in zip(self.logits_lens, self.top_nums, strict=True) if top is not None)

    def sample_rows(self, device: torch.device) -> torch.Tensor:
        """int64: the logits rows the sampler reads: a scoring request's last row (its next token),
        every row of any other request."""
        rows, start = [], 0
        for n, top in zip(self.logits_lens, self.top_nums, strict=True):
            rows.extend([start + n - 1] if top is not None else range(start, start + n))
            start += n
        return torch.tensor(rows, dtype=torch.int64, device=device)

    def select(self, rows: list[int]) -> PromptLogprobRows:
        """The rows of the requests ``rows`` alone (a sub-batch, in that order)."""
        lens, targets, tops = self.logits_lens, self.targets, self.top_nums
        return PromptLogprobRows([lens[r] for r in rows], [targets[r] for r in rows], [tops[r] for r in rows])

    def compute(self, logits: torch.Tensor) -> list[list[PromptLogprob]]:
        """Each request's prompt logprobs from the batch's logits (``[N, V]``, ``N = sum(logits_lens)``,
        the model's dtype): log_softmax of the raw logits in float32 (no temperature, penalty or
        grammar: the model's own distribution), the ``top_nums[b]`` most likely tokens, and each prompt
        token's rank (1 + the tokens with a greater logprob).

        Returns ``[B]`` lists, ``len(targets[b])`` entries each (token order).
        """
        starts = [0]
        for n in self.logits_lens[:-1]:
            starts.append(starts[-1] + n)
        index = [s + j for s, t in zip(starts, self.targets, strict=True) for j in range(len(t))]
        out: list[list[PromptLogprob]] = [[] for _ in self.targets]
        if not index:
            return out
        device = logits.device
        logprobs = torch.log_softmax(logits[torch.tensor(index, device=device)].float(), dim=-1)
        ids = torch.tensor([t for ts in self.targets for t in ts], dtype=torch.int64, device=device)
        chosen_t = logprobs.gather(1, ids[:, None])
        ranks = ((logprobs > chosen_t).sum(dim=-1) + 1).tolist()
        chosen = chosen_t.squeeze(1).tolist()
        k = min(max(top or 0 for top in self.top_nums), logprobs.shape[-1])
        tops: list[list[tuple[int, float]]] = [[] for _ in index]
        if k:
            values, indices = logprobs.topk(k, dim=-1)
            tops = [
                [(t, v) for t, v in zip(i, vs, strict=True) if v != -math.inf]
                for i, vs in zip(indices.tolist(), values.tolist(), strict=True)
            ]
        flat = 0
        for b, targets in enumerate(self.targets):
            for token in targets:
                out[b].append((token, chosen[flat], tops[flat][: self.top_nums[b] or 0], ranks[flat]))
                flat += 1
        return out
