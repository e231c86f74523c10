"""The proposer interface: what a drafter of speculative decoding gets and returns.

One step of speculative decoding (Leviathan et al. 2023; Chen et al. 2023) for a running request
whose sequence is ``prompt + outputs`` (its last output has no KV in the target yet: it is the next
step's input):

1. the scheduler asks the proposer for up to ``k`` draft tokens ``d_0 .. d_{k-1}`` (``propose``);
2. the target runs its last token and the drafts in one forward (``ForwardMode.TARGET_VERIFY``)
   and the sampler keeps ``d_0 .. d_{a-1}`` plus one token of its own (``pdserve.sampling.verify``);
3. the scheduler gives back the KV slots of the rejected positions (``KVLedger.truncate``).

A proposer holds no target KV: it reads the request's token ids (and, for a draft head, the target's
hidden states), keeps whatever state of its own it needs under the request's ``rid`` (an n-gram
index; a draft model's KV pages in its own pool) and re-syncs that state from the tokens it is given
each step, so rejected drafts, retraction or a migrated request never leave it out of step.
``release(rid)`` frees that state when the request ends.

Where EAGLE-3 / MTP heads plug in (not built here): a head drafts from the target's own features, so
``DraftRequest.hidden_states`` carries the target's final (normed) hidden states, ``[n, hidden]``
float, of the request's positions the last verify step kept (``ModelRunner.forward_hidden_and_logits``
returns them beside the logits; EAGLE-3 also reads low and middle layers' states, which the model
would expose the same way). Such a proposer runs its head (one decoder layer with its own small KV
pool, plus the target's LM head) ``k`` times from those features, like ``DraftModelProposer`` does
with a whole model, and returns ``q`` where it samples.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdserve.sampling.sampling_params import SamplingParams


@dataclass(slots=True)
class DraftRequest:
    """What a proposer gets for one request.

    Attributes:
        rid: the request's id: a proposer keeps its per-request state under it.
        prompt_ids / output_ids: the request's prompt and its verified outputs (read, not copied:
            do not change them); drafts follow the last output.
        num_drafts: at most this many draft tokens (``k >= 1``).
        sampling_params: the request's; a proposer that samples draws ``q`` under them.
        hidden_states: the target's final hidden states ``[n, hidden]`` of the positions the last
            verify step kept, for a draft head (EAGLE / MTP); None where the scheduler has none.
    """

    rid: str
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    num_drafts: int
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    hidden_states: torch.Tensor | None = None


@dataclass(slots=True)
class Drafts:
    """What a proposer returns, one entry per request in order.

    Attributes:
        token_ids: up to ``num_drafts`` draft tokens per request (none where it has no guess).
        probs: per request, float32 ``[len(token_ids[i]), V]``: the distribution ``q`` each draft
            token was sampled from, or None where the drafts are deterministic (an n-gram match, a
            greedy draft): ``pdserve.sampling.verify`` then treats ``q`` as a point mass.
    """

    token_ids: list[list[int]]
    probs: list[torch.Tensor | None] | None = None


class Proposer(ABC):
    """Drafts tokens for a batch of running requests.

    Attributes:
        drafts_are_free: proposing costs next to nothing (no model runs): the adaptive policy then
            also proposes for requests that do not verify this step and scores those drafts
            against the tokens they then generate, so it learns their acceptance without verifying.
    """

    drafts_are_free: bool = False

    @abstractmethod
    def propose(self, reqs: Sequence[DraftRequest]) -> Drafts:
        """Up to ``req.num_drafts`` draft tokens for each request."""

    def release(self, rid: str) -> None:  # noqa: B027 (a proposer without per-request state keeps none)
        """Forget ``rid``'s state (the request ended)."""
