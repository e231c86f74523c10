"""Verifying draft tokens (speculative decoding): what each position of a verify batch samples
under, and which tokens the request keeps.

A request verifying ``k`` draft tokens ``d_0 .. d_{k-1}`` after its last token has ``k + 1`` logits
rows; row ``j`` predicts the token after ``d_{j-1}`` (row 0: after the last token). Every row is
sampled as non-speculative decoding would sample that position, with the request's processing
applied position by position as if the draft had been decoded one token at a time: penalties count
``d_0 .. d_{j-1}`` as output, ``min_new_tokens`` bans and step seeds follow the position, and a
grammar masks row ``j`` with its state after ``d_0 .. d_{j-1}`` (drafts that break the grammar are
cut). The request then keeps ``d_0 .. d_{a-1}`` for the longest prefix whose samples equal the
draft (``a <= k``), and row ``a``'s sample after them: the first token that differs, or after
``k`` acceptances the bonus token. So it gains ``a + 1`` tokens from one forward.

- Deterministic drafts (n-gram, a greedy draft model; ``q`` a point mass): each row samples ``p``
  with its own seeded or global random number, exactly as outside a verify batch; keeping the
  samples up to the first one that differs from the draft is the rejection rule of Leviathan et
  al. 2023 with ``q = δ(d_j)`` (accept with probability ``p(d_j)``, else a sample of ``p`` without
  ``d_j``), and a seeded request's tokens equal its non-speculative ones.
- Sampled drafts (a draft model sampling ``q``): ``pdserve.sampling.rejection`` decides the row.
- Greedy requests: the argmax of each row, so exact match.

Logprobs and top logprobs of a kept token are those of its row: the same as non-speculative
decoding's at that position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.constrained.grammar import Grammar, PositionMask
from pdserve.sampling.draft_rows import DraftRows
from pdserve.sampling.sampler import GenerationBatchResult
from pdserve.sampling.sampling_batch_info import SamplingBatchInfo
from pdserve.sampling.sampling_params import SamplingParams


@dataclass(slots=True)
class VerifyInputs:
    """What a verify batch samples with, built by ``verify_inputs``.

    Attributes:
        drafts: per request its draft tokens, cut where its grammar refuses one.
        logits_lens: per request ``len(drafts[i]) + 1`` (``ForwardBatch.logits_lens``).
        sampling_info: one row per position (``sum(logits_lens)`` rows).
        top_logprobs_nums: per row, its request's.
        draft_rows: the draft token (and ``q``) of each row, for the sampler.
    """

    drafts: list[list[int]]
    logits_lens: list[int]
    sampling_info: SamplingBatchInfo
    top_logprobs_nums: list[int]
    draft_rows: DraftRows


def verify_inputs(
    params: Sequence[SamplingParams],
    output_ids: Sequence[list[int]],
    prompt_ids: Sequence[list[int]],
    drafts: Sequence[Sequence[int]],
    eos_token_ids: list[int],
    vocab_size: int,
    device: torch.device | str = "cpu",
    grammars: Sequence[Grammar | None] | None = None,
    output_lens: Sequence[int] | None = None,
    draft_probs: Sequence[torch.Tensor | None] | None = None,
) -> VerifyInputs:
    """The sampling rows of a batch whose request ``i`` verifies ``drafts[i]`` (none for a request
    that extends or decodes as usual), as ``SamplingBatchInfo.build`` takes its arguments.

    A grammar's matcher walks each draft to give every row its mask, and is back where it was
    after: a draft is cut before the first token the grammar refuses, and after a token that ends
    the grammar (nothing may follow). ``output_ids`` must be complete (no pending tokens) for a
    penalised request, as for ``SamplingBatchInfo.build``.
    """
    lens = list(output_lens) if output_lens is not None else [len(out) for out in output_ids]
    cut: list[list[int]] = []
    row_params, row_outputs, row_prompts, row_lens = [], [], [], []
    row_grammars: list[Grammar | PositionMask | None] = []
    for i, draft in enumerate(drafts):
        grammar = grammars[i] if grammars is not None else None
        masks = None
        if grammar is not None:
            masks = grammar.masks_along(list(draft), vocab_size)
            draft = draft[: len(masks) - 1]
        cut.append(list(draft))
        for j in range(len(draft) + 1):
            row_params.append(params[i])
            row_outputs.append(output_ids[i] + list(draft[:j]) if j else output_ids[i])
            row_prompts.append(prompt_ids[i])
            row_lens.append(lens[i] + j)
            row_grammars.append(None if masks is None else masks[j])
    info = SamplingBatchInfo.build(
        row_params,
        output_ids=row_outputs,
        prompt_ids=row_prompts,
        eos_token_ids=eos_token_ids,
        vocab_size=vocab_size,
        device=device,
        grammars=row_grammars,
        output_lens=row_lens,
    )
    return VerifyInputs(
        drafts=cut,
        logits_lens=[len(d) + 1 for d in cut],
        sampling_info=info,
        top_logprobs_nums=[p.top_logprobs_num or 0 for p in row_params],
        draft_rows=DraftRows.build(cut, draft_probs, device),
    )


@dataclass(slots=True)
class Accepted:
    """What one request keeps from a verify step.

    Attributes:
        token_ids: its accepted draft tokens, then the row's own token after them (``a + 1`` ids).
        logprobs: the logprob of each (None when the batch returned none).
        top_logprobs: the top logprobs of each position (None when the batch returned none).
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def num_accepted_drafts(self) -> int:
        return len(self.token_ids) - 1

    def logprob(self, j: int) -> tuple[float, list[tuple[int, float]]] | None:
        """The logprob and top logprobs of the ``j``-th kept token, when the batch computed them."""
        if self.logprobs is None:
            return None
        return self.logprobs[j], self.top_logprobs[j] if self.top_logprobs else []


def accept(result: GenerationBatchResult, drafts: Sequence[Sequence[int]]) -> list[Accepted]:
    """Per request, the longest prefix of its rows whose samples equal its draft tokens, and the
    next row's sample: ``result`` holds one sample per row (``len(drafts[i]) + 1`` rows each, in
    request order), sampled under ``verify_inputs``' rows."""
    out, start = [], 0
    ids = result.next_token_ids
    for draft in drafts:
        a = 0
        while a < len(draft) and ids[start + a] == draft[a]:
            a += 1
        end = start + a + 1
        out.append(
            Accepted(
                ids[start:end],
                None if result.next_token_logprobs is None else result.next_token_logprobs[start:end],
                None if result.top_logprobs is None else result.top_logprobs[start:end],
            )
        )
        start += len(draft) + 1
    return out
