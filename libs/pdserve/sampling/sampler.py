"""Sampler: penalties, greedy / temperature / top-k / top-p / min-p sampling, and logprobs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.constrained.grammar import apply_grammars
from pdserve.layers.cpu_fused_ops import load_fused_ops
from pdserve.sampling.rejection import rejection_sample
from pdserve.sampling.sampling_batch_info import SamplingBatchInfo
from pdserve.sampling.uniforms import uniforms

if TYPE_CHECKING:
    from pdserve.sampling.draft_rows import DraftRows
    from pdserve.sampling.prompt_logprobs import PromptLogprob


@dataclass(slots=True)
class GenerationBatchResult:
    """What one forward step produced, one entry per request in batch order.

    Attributes:
        next_token_ids: the sampled token of each request.
        next_token_tensor: the same as an int64 ``[B]`` tensor on the device (a batch scheduled ahead
            reads its decode inputs from it on the device).
        next_token_logprobs: log-probability of each sampled token under the raw model distribution
            (log_softmax of the logits before temperature, penalties and filters, as OpenAI reports
            it; for a constrained request, of the logits masked by its grammar, as vLLM reports
            it); None when no request asked for logprobs.
        top_logprobs: per request, up to ``top_logprobs_num`` most likely ``(token_id, logprob)``
            pairs (empty where it asked for none; tokens its grammar forbids are left out); None
            when no request asked for any.
        prompt_logprobs: per request, the prompt tokens its chunk scored (token id, logprob, top
            pairs; ``pdserve.sampling.prompt_logprobs``); None when no request of the batch asked.
        pooled: per request, what its chunk pooled (float32 ``[H]`` tensors, None for a request
            that does not embed; ``pdserve.layers.pooler``); None when no request of the batch embeds.
    """

    next_token_ids: list[int]
    next_token_tensor: torch.Tensor | None = None
    next_token_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[list[PromptLogprob]] | None = None
    pooled: list[torch.Tensor | None] | None = None


class Sampler:
    """Turns the logits of a batch into tokens: one per request, or one per position of a verify
    batch (then ``drafts`` says which draft token each position checks; see
    ``pdserve.sampling.verify``)."""

    def __call__(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo | None,
        return_logprob: bool = False,
        top_logprobs_nums: list[int] | None = None,
        drafts: DraftRows | None = None,
    ) -> GenerationBatchResult:
        """Sample one token per row of ``logits`` (``[N, V]``, the model's dtype); ``info=None`` means
        greedy. A batch that only takes each row's argmax reads the logits as they are (the largest
        bfloat16 value is the largest after a cast); anything else works on a float32 copy.
        Constrained rows (``info.grammars``) are masked by their grammar first.

        With ``drafts``, a row whose draft token was sampled from a distribution ``q`` (a draft
        model's) decides by the rejection rule instead of sampling afresh
        (``pdserve.sampling.rejection``); every other row samples as it would outside a verify
        batch, so the samples equal non-speculative decoding's where the drafts are deterministic."""
        top_k_max = min(max(top_logprobs_nums or [0]), logits.shape[-1])
        if return_logprob or top_k_max or not (info is None or info.argmax_only):
            logits = logits.float()
        constrained = apply_grammars(logits, info.grammars) if info is not None and info.grammars else []
        raw_logprobs = torch.log_softmax(logits, dim=-1) if return_logprob or top_k_max else None
        next_ids = self._sample(logits, info, constrained, drafts)
        result = GenerationBatchResult(next_token_ids=next_ids.tolist(), next_token_tensor=next_ids)
        if raw_logprobs is not None:
            result.next_token_logprobs = raw_logprobs.gather(1, next_ids[:, None]).squeeze(1).tolist()
        if raw_logprobs is not None and top_k_max:
            values, indices = raw_logprobs.topk(top_k_max, dim=-1)
            pairs = [
                [(t, lp) for t, lp in zip(i, v, strict=True) if lp != -math.inf]
                for i, v in zip(indices.tolist(), values.tolist(), strict=True)
            ]
            result.top_logprobs = [row[:n] for row, n in zip(pairs, top_logprobs_nums, strict=True)]
        return result

    def _sample(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo | None,
        constrained: list[int],
        drafts: DraftRows | None = None,
    ) -> torch.Tensor:
        if info is None:
            return _argmax(logits)
        masked = logits
        logits = _apply_penalties(logits, info)
        if constrained and logits is not masked:
            # A grammar that allows only EOS while min_tokens still bans it leaves a row nothing:
            # the grammar wins (its output is complete), so such a row samples its masked logits.
            rows = torch.tensor(constrained, device=logits.device)
            dead = rows[torch.isneginf(logits[rows]).all(dim=-1)]
            logits[dead] = masked[dead]
        next_ids = _argmax(logits)
        if info.all_greedy:
            return next_ids
        rows = (~info.is_greedy).nonzero().squeeze(1)
        next_ids[rows] = _sample_rows(logits[rows], info, rows)
        if drafts is not None and drafts.prob_rows is not None:
            sampled = drafts.prob_rows[~info.is_greedy[drafts.prob_rows]]  # greedy rows: argmax decides
            if len(sampled):
                probs = target_probs(logits[sampled], info, sampled)
                q = drafts.probs[~info.is_greedy[drafts.prob_rows]]
                seeds = [info.step_seeds[i] for i in sampled.tolist()]
                next_ids[sampled] = rejection_sample(probs, q, drafts.token_ids[sampled], seeds)
        return next_ids


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]``: each row's first largest logit (a parallel C loop on CPU, ``cpu_fused_ops``:
    PyTorch's argmax of a ``[64, 49152]`` batch runs on one thread, ~2.5 ms here)."""
    ops = load_fused_ops()
    if ops is not None and ops.supports(logits) and logits.is_contiguous():
        return ops.argmax(logits)
    return logits.argmax(dim=-1)


def _apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Repetition penalty (CTRL, Keskar et al. 2019), then the additive bias (the requests' logit_bias,
    frequency/presence penalties, bans)."""
    if info.repetition_mask is not None:
        penalised = torch.where(
            logits > 0, logits / info.repetition_penalties, logits * info.repetition_penalties
        )
        logits = torch.where(info.repetition_mask, penalised, logits)
    if info.logit_bias is not None:
        logits = logits + info.logit_bias
    return logits


def _filtered_sorted(
    logits: torch.Tensor, info: SamplingBatchInfo, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution the non-greedy ``rows`` sample from, descending: float32 ``[n, k]``
    probabilities after temperature, zeroed where top-k / top-p / min-p filter them out (not
    renormalised), and int64 ``[n, k]`` their token ids (``k`` the largest top-k, else ``V``)."""
    probs = torch.softmax(logits / info.temperatures[rows], dim=-1)
    top_ks = info.top_ks[rows]
    k = min(int(top_ks.max()), info.vocab_size) if info.need_top_k else info.vocab_size
    if k < info.vocab_size:
        sorted_probs, order = probs.topk(k, dim=-1)
    else:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if info.need_top_k:
        keep &= torch.arange(k, device=logits.device)[None, :] < top_ks[:, None]
    if info.need_top_p:  # nucleus (Holtzman et al. 2019): the mass before a token must be < top_p
        keep &= (sorted_probs.cumsum(dim=-1) - sorted_probs) < info.top_ps[rows, None]
    if info.need_min_p:
        keep &= sorted_probs >= info.min_ps[rows, None] * sorted_probs[:, :1]
    return sorted_probs * keep, order


def _sample_rows(logits: torch.Tensor, info: SamplingBatchInfo, rows: torch.Tensor) -> torch.Tensor:
    """Sample the non-greedy ``rows`` by inverse-CDF over the filtered, descending-sorted probabilities.

    Each row draws one uniform number, from its own stateless generator when seeded, so its token
    depends only on its own logits and seed.
    """
    kept, order = _filtered_sorted(logits, info, rows)
    cdf = kept.cumsum(dim=-1)
    uniform = uniforms([info.step_seeds[i] for i in rows.tolist()], logits.device)
    picks = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)
    picks.clamp_(max=order.shape[1] - 1)
    return order.gather(1, picks).squeeze(1)


def target_probs(logits: torch.Tensor, info: SamplingBatchInfo, rows: torch.Tensor) -> torch.Tensor:
    """float32 ``[n, V]``: the distribution the non-greedy ``rows`` sample from (``logits`` their
    processed logits, ``[n, V]``: penalties, bias and grammar applied), renormalised after
    temperature and the top-k / top-p / min-p filters: the ``p`` of speculative sampling."""
    kept, order = _filtered_sorted(logits, info, rows)
    dense = torch.zeros_like(logits, dtype=torch.float32)
    return dense.scatter_(1, order, kept / kept.sum(dim=-1, keepdim=True))
