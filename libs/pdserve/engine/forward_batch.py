"""``ForwardBatch``: the device contract of one forward step (SGLang's ``forward_batch_info.py``).

The scheduler decides everything in it — which tokens run, their positions and the KV slots they
write — and has already written ``req_to_token[req_pool_idx, prefix_len:seq_len]`` (the slots in
``out_cache_loc``) before the forward. The model and attention backend only consume it.

Slots are paged: position ``p`` of a request lives at ``page * page_size + p % page_size`` of the
page holding its ``p // page_size``-th block (``slots_for_pages`` writes exactly that), which is
what lets attention backends read KV page by page.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pdserve.layers.pooler import PoolingRows
from pdserve.mem_cache.memory_pool import KVPool, ReqToTokenPool
from pdserve.mem_cache.swa_pool import SWAKVPool
from pdserve.sampling.draft_rows import DraftRows
from pdserve.sampling.prompt_logprobs import PromptLogprobRows
from pdserve.sampling.sampling_batch_info import SamplingBatchInfo

IntSeq = torch.Tensor | Sequence[int]


class BatchAttention(Protocol):
    """What the attention layers of a forward call on the batch's ``attn_backend``: implemented by
    every ``pdserve.layers.attention.base.AttentionBackend`` (named here, so that the device contract
    does not import the kernels that consume it)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """``q`` ``[T, Hq * D]``, ``k``/``v`` ``[T, Hkv * D]`` of ``layer`` → ``[T, Hq * D]``."""


class ForwardMode(enum.Enum):
    """EXTEND: every request computes >= 1 new tokens after its cached prefix (prefill or a chunk);
    DECODE: every request computes exactly its one last token; MIXED: extending and decoding
    requests in one batch (verifying ones too); TARGET_VERIFY (speculative decoding, SGLang's
    name): every request computes its last token and ``k >= 0`` draft tokens after it, with logits
    at each of them (a decoding request is one with ``k = 0``).

    Attention treats a verifying request as an extend of ``k + 1`` tokens after its cached prefix
    (each query attends to the keys up to its own position); only the logits differ.
    """

    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"
    TARGET_VERIFY = "target_verify"


@dataclass(slots=True)
class ForwardBatch:
    """Tokens of ``B`` requests, concatenated request by request: ``T = sum(extend_seq_lens)``.

    Attributes:
        input_ids / positions / out_cache_loc: int64 ``[T]``: token ids, their sequence positions,
            and the KV token slot each one writes.
        req_pool_indices: int64 ``[B]``: request slot (row of ``req_to_token``).
        seq_lens: int64 ``[B]``: sequence length after this forward.
        extend_prefix_lens: int64 ``[B]``: tokens already in the KV pool (cached prefix).
        extend_seq_lens: int64 ``[B]``: tokens computed this step (1 for a decoding request).
        extend_start_loc: int64 ``[B]``: flat index of each request's first token this step.
        logits_lens: int64 ``[B]``: logits are computed at each request's last ``logits_lens[b]``
            positions (``k + 1`` for a request verifying ``k`` draft tokens, its extend length for
            one scoring its prompt, else 1).
        logits_index: int64 ``[N]``, ``N = sum(logits_lens)``: the flat token indices whose logits
            are computed, request by request (``N = B``: each request's last token, without drafts).
        sampling_info: sampling tensors of the ``N`` logits rows (one per request without drafts),
            or None for greedy.
        return_logprob / top_logprobs_nums: what logprobs to return (per logits row for the top ones).
        draft_rows: the draft token each logits row checks (a batch that verifies drafts), else None.
        prompt_logprobs: which logits rows score prompt tokens (requests that asked for prompt
            logprobs have logits at every position of their chunk, and sample from the last), else
            None (``pdserve.sampling.prompt_logprobs``).
        pooling: which requests pool their chunk's hidden states into an embedding, else None
            (``pdserve.layers.pooler``).
        swa_out_cache_loc: int64 ``[T]``: the slots the tokens write in the local pool of an
            ``SWAKVPool`` (its sliding-window layers), else None.
        swa_page_rows: int64 ``[B, max_pages]``: each request's pages in that local pool
            (``SWAKVPool.swa_page_rows``), else None.
        lora_slots: int64 ``[T]``: each token's LoRA adapter slot (``pdserve.lora``; -1 for the base
            model), or None when no token has an adapter.
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    out_cache_loc: torch.Tensor
    logits_lens: torch.Tensor
    logits_index: torch.Tensor
    sampling_info: SamplingBatchInfo | None
    return_logprob: bool
    top_logprobs_nums: list[int] | None
    draft_rows: DraftRows | None
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: KVPool | SWAKVPool
    attn_backend: BatchAttention
    prompt_logprobs: PromptLogprobRows | None = None
    pooling: PoolingRows | None = None
    swa_out_cache_loc: torch.Tensor | None = None
    swa_page_rows: torch.Tensor | None = None
    lora_slots: torch.Tensor | None = None

    @property
    def num_sample_rows(self) -> int:
        """Rows the sampler samples: one per logits row, less the rows that only score prompt
        tokens (``PromptLogprobRows.sample_rows``)."""
        scoring = self.prompt_logprobs
        return len(self.logits_index) - (scoring.num_prompt_only_rows if scoring is not None else 0)

    @classmethod
    def init_new(
        cls,
        *,
        input_ids: IntSeq,
        req_pool_indices: IntSeq,
        seq_lens: IntSeq,
        runner: Any,
        out_cache_loc: IntSeq | None = None,
        extend_prefix_lens: IntSeq | None = None,
        extend_seq_lens: IntSeq | None = None,
        forward_mode: ForwardMode | None = None,
        logits_lens: IntSeq | None = None,
        sampling_info: SamplingBatchInfo | None = None,
        return_logprob: bool = False,
        top_logprobs_nums: list[int] | None = None,
        draft_rows: DraftRows | None = None,
        prompt_logprobs: PromptLogprobRows | None = None,
        pooling: PoolingRows | None = None,
        lora_slots: IntSeq | None = None,
    ) -> ForwardBatch:
        """Build from plain tensors or lists; positions (and whichever of ``extend_prefix_lens`` /
        ``extend_seq_lens`` is missing) are derived. ``runner`` is the ``ModelRunner`` owning the
        pools and the attention backend. ``out_cache_loc`` defaults to the slots the scheduler wrote
        into ``req_to_token`` at each token's (request slot, position), read in one gather.
        ``logits_lens`` defaults to 1 per request (its last token). ``forward_mode`` defaults to
        DECODE when every request computes one token, else TARGET_VERIFY when logits are computed
        at every token of every request, else EXTEND (MIXED when some, not all, have logits at
        several positions). ``lora_slots`` (``[B]``, -1 for the base model) is each request's
        LoRA adapter slot, spread to its tokens (None when every slot is -1).

        Raises:
            ValueError: lengths disagree (``T`` tokens, ids and KV slots), both
                ``extend_prefix_lens`` and ``extend_seq_lens`` are missing, a ``logits_lens`` entry
                is outside ``[1, extend_seq_lens]``, a DECODE batch computes more than one token
                for a request, or a TARGET_VERIFY batch lacks logits at one of its tokens.
        """
        device = runner.device

        def as_long(values: IntSeq) -> torch.Tensor:
            return torch.as_tensor(values, dtype=torch.int64).to(device)

        seq = as_long(seq_lens)
        if extend_seq_lens is None and extend_prefix_lens is None:
            raise ValueError("give extend_seq_lens or extend_prefix_lens")
        ext = as_long(extend_seq_lens) if extend_seq_lens is not None else seq - as_long(extend_prefix_lens)
        prefix = as_long(extend_prefix_lens) if extend_prefix_lens is not None else seq - ext
        ids, pool_rows = as_long(input_ids), as_long(req_pool_indices)
        loc = None if out_cache_loc is None else as_long(out_cache_loc)
        num_tokens = int(ext.sum())
        if (
            not (len(ids) == num_tokens == (num_tokens if loc is None else len(loc)))
            or bool((prefix + ext != seq).any())
            or bool((ext < 1).any())
        ):
            raise ValueError(
                f"inconsistent batch: {len(ids)} input ids, {'derived' if loc is None else len(loc)} KV "
                f"slots, extend lens {ext.tolist()} (each >= 1, summing to the tokens), prefix "
                f"{prefix.tolist()} + extend must equal seq {seq.tolist()}"
            )
        all_decode = num_tokens == len(ext)  # every extend len is >= 1 (checked above)
        if all_decode:  # one token per request: no ragged layout to compute
            starts = torch.arange(len(ext), device=device)
            positions = prefix
            if loc is None:
                loc = runner.req_to_token_pool.req_to_token[pool_rows, positions]
        else:
            starts = torch.cumsum(ext, 0) - ext
            offsets = torch.repeat_interleave(starts - prefix, ext)
            positions = torch.arange(num_tokens, device=device) - offsets
            if loc is None:
                loc = runner.req_to_token_pool.req_to_token[pool_rows.repeat_interleave(ext), positions]
        last = starts + ext - 1
        if logits_lens is None:
            num_logits, logits_index = torch.ones_like(ext), last
        else:
            num_logits = as_long(logits_lens)
            if len(num_logits) != len(ext) or bool(((num_logits < 1) | (num_logits > ext)).any()):
                raise ValueError(
                    f"logits lens {num_logits.tolist()} must be in [1, extend lens {ext.tolist()}]"
                )
            ends = torch.cumsum(num_logits, 0)
            # request b's last num_logits[b] tokens: flat rows ends[b] - n .. ends[b] - 1 shifted to them
            logits_index = torch.arange(int(ends[-1]), device=device) + torch.repeat_interleave(
                last + 1 - ends, num_logits
            )
        verifies_all = logits_lens is not None and bool((num_logits == ext).all())
        if forward_mode is None:
            if all_decode:
                forward_mode = ForwardMode.DECODE
            elif verifies_all:
                forward_mode = ForwardMode.TARGET_VERIFY
            else:
                forward_mode = ForwardMode.MIXED if len(logits_index) > len(ext) else ForwardMode.EXTEND
        elif forward_mode is ForwardMode.DECODE and not all_decode:
            raise ValueError(f"a DECODE batch computes one token per request, got extend lens {ext.tolist()}")
        elif forward_mode is ForwardMode.TARGET_VERIFY and not verifies_all:
            raise ValueError(
                f"a TARGET_VERIFY batch has logits at every token: logits lens "
                f"{num_logits.tolist()}, extend lens {ext.tolist()}"
            )
        swa = None
        if isinstance(pool := runner.kv_pool, SWAKVPool):
            rows = pool.swa_page_rows(runner.req_to_token_pool.req_to_token, pool_rows, seq)
            swa = pool.swa_slots(loc), rows
        return cls(
            forward_mode=forward_mode,
            batch_size=len(seq),
            input_ids=ids,
            positions=positions,
            req_pool_indices=pool_rows,
            seq_lens=seq,
            extend_prefix_lens=prefix,
            extend_seq_lens=ext,
            extend_start_loc=starts,
            out_cache_loc=loc,
            logits_lens=num_logits,
            logits_index=logits_index,
            sampling_info=sampling_info,
            return_logprob=return_logprob,
            top_logprobs_nums=top_logprobs_nums,
            draft_rows=draft_rows,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool=runner.kv_pool,
            attn_backend=runner.attn_backend,
            prompt_logprobs=prompt_logprobs,
            pooling=pooling,
            swa_out_cache_loc=None if swa is None else swa[0],
            swa_page_rows=None if swa is None else swa[1],
            lora_slots=_token_slots(lora_slots, ext, device),
        )


def _token_slots(
    request_slots: IntSeq | None, ext: torch.Tensor, device: torch.device
) -> torch.Tensor | None:
    """Each token's LoRA slot (int64 ``[T]``) from each request's (``[B]``); None when none has one."""
    if request_slots is None or all(int(s) < 0 for s in request_slots):
        return None
    return torch.as_tensor(request_slots, dtype=torch.int64).to(device).repeat_interleave(ext)
