"""What the forward thread does with a ``ScheduleBatch``: fill in its pending inputs, run it, and when
the forward raises, find the requests responsible so that only they fail.

Isolation is by bisection: a batch whose forward raises is split in two halves that run on their own,
recursively, down to single requests; a request that fails alone is the one responsible (or one of
them), and every other request gets the token its own sub-batch sampled. A sub-batch samples each
request exactly as the whole batch would (each row's logits depend only on its own tokens and KV,
and ``SamplingBatchInfo.select`` keeps each row's parameters and seed), and re-running a forward
rewrites the same KV slots with the same values, so batch-mates keep their exact outputs. A
failure costs at most ``2 * B - 1`` extra forwards for a batch of ``B``; one that every request
causes alone (a broken device) fails them all. A batch that verifies speculative drafts is bisected
the same way: a verifying request's sampling rows (one per position, ``ForwardBatch.draft_rows``)
go with it into its sub-batch, and back to their places in the merged result.
"""

from __future__ import annotations

import logging

import torch

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.sampling.sampler import GenerationBatchResult
from pdserve.scheduler.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)


def run_batch(runner, batch: ScheduleBatch) -> ScheduleBatch:
    """Run ``batch`` on ``runner`` (the ``ModelRunner``); set ``batch.result`` (one token per row, 0
    for failed rows) and ``batch.row_errors``. Never raises: an error that is no one request's fails
    every row. Returns ``batch``.

    Except under tensor parallelism (``runner.isolates_failures`` False): there any error raises, and
    the rank group goes down (ranks that bisected apart would never meet in their collectives again).
    """
    isolate = getattr(runner, "isolates_failures", True)
    try:
        batch.resolve()
    except Exception as e:  # no request's fault: the step before left nothing to decode
        if not isolate:
            raise
        logger.exception("inputs of a batch of %d requests could not be resolved", len(batch.reqs))
        _fail_all(batch, e)
        return batch
    try:
        batch.result = runner.forward_batch_generation(batch.forward_batch)
        return batch
    except Exception as e:  # any error of the forward is isolated, then reported per row
        if not isolate:
            raise
        if len(batch.reqs) == 1:
            _fail_all(batch, e)
            return batch
        logger.warning(
            "forward of %d requests failed (%s): isolating the ones responsible", len(batch.reqs), e
        )
    rows = list(range(len(batch.reqs)))
    results: dict[int, _RowResult] = {}
    counts = _sample_counts(batch.forward_batch)
    _bisect(runner, batch.forward_batch, counts, rows, results, batch.row_errors)
    batch.result = _merge(batch, counts, results)
    if batch.row_errors:
        logger.warning(
            "forward failure isolated to %d of %d requests: %s",
            len(batch.row_errors),
            len(batch.reqs),
            ", ".join(batch.reqs[i].rid for i in batch.row_errors),
        )
    return batch


# a request row's sub-batch result: (the result, the request's index in it, its sampling rows there)
_RowResult = tuple[GenerationBatchResult, int, range]


def _sample_counts(fb: ForwardBatch) -> list[int]:
    """Sampling rows of each request of ``fb``: ``k + 1`` for one verifying ``k`` drafts, else 1
    (one scoring its prompt samples its last logits row only)."""
    lens = fb.logits_lens.tolist()
    scoring = fb.prompt_logprobs
    if scoring is None:
        return lens
    return [1 if top is not None else n for n, top in zip(lens, scoring.top_nums, strict=True)]


def _sample_rows(counts: list[int], rows: list[int]) -> list[range]:
    """Where the sampling rows of each of ``rows`` lie in a batch of requests with ``counts``."""
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    return [range(starts[r], starts[r] + counts[r]) for r in rows]


def _bisect(
    runner,
    fb: ForwardBatch,
    counts: list[int],
    rows: list[int],
    results: dict[int, _RowResult],
    errors: dict[int, str],
) -> None:
    """Run ``rows`` of ``fb`` alone; on failure split them, down to single rows whose error is kept."""
    for half in (rows[: len(rows) // 2], rows[len(rows) // 2 :]):
        if not half:
            continue
        try:
            result = runner.forward_batch_generation(_select(fb, counts, half, runner))
        except Exception as e:  # narrowed down below
            if len(half) == 1:
                errors[half[0]] = f"forward failed: {type(e).__name__}: {e}"
            else:
                _bisect(runner, fb, counts, half, results, errors)
            continue
        placed = _sample_rows([counts[r] for r in half], list(range(len(half))))
        for j, row in enumerate(half):
            results[row] = (result, j, placed[j])


def _select(fb: ForwardBatch, counts: list[int], rows: list[int], runner) -> ForwardBatch:
    """The forward batch of ``rows`` of ``fb`` alone (ids, positions and KV slots as they were; each
    request's sampling rows, ``counts`` of them, with it)."""
    sample = [s for span in _sample_rows(counts, rows) for s in span]
    idx = torch.tensor(rows, dtype=torch.int64, device=fb.input_ids.device)
    starts, lens = fb.extend_start_loc[idx], fb.extend_seq_lens[idx]
    tokens = torch.cat(
        [
            torch.arange(s, s + n, device=idx.device)
            for s, n in zip(starts.tolist(), lens.tolist(), strict=True)
        ]
    )
    return ForwardBatch.init_new(
        input_ids=fb.input_ids[tokens],
        req_pool_indices=fb.req_pool_indices[idx],
        seq_lens=fb.seq_lens[idx],
        extend_prefix_lens=fb.extend_prefix_lens[idx],
        extend_seq_lens=lens,
        out_cache_loc=fb.out_cache_loc[tokens],
        sampling_info=None if fb.sampling_info is None else fb.sampling_info.select(sample),
        return_logprob=fb.return_logprob,
        top_logprobs_nums=None if fb.top_logprobs_nums is None else [fb.top_logprobs_nums[i] for i in sample],
        draft_rows=None if fb.draft_rows is None else fb.draft_rows.select(sample),
        runner=runner,
        logits_lens=fb.logits_lens[idx],
        prompt_logprobs=None if fb.prompt_logprobs is None else fb.prompt_logprobs.select(rows),
        pooling=None if fb.pooling is None else fb.pooling.select(rows),
        lora_slots=None if fb.lora_slots is None else fb.lora_slots[starts],
    )


def _merge(batch: ScheduleBatch, counts: list[int], results: dict[int, _RowResult]) -> GenerationBatchResult:
    """One result for the whole batch from the sub-batches' (failed rows: token 0, no logprobs),
    each request's sampling rows back in their places."""
    n, num_rows = len(batch.reqs), sum(counts)
    ids = [0] * num_rows
    logprobs: list[float] | None = None
    tops: list[list[tuple[int, float]]] | None = None
    prompts = [[] for _ in range(n)] if batch.forward_batch.prompt_logprobs is not None else None
    pooled = [None] * n if batch.forward_batch.pooling is not None else None
    places = _sample_rows(counts, list(range(n)))
    for row, (result, j, sub_rows) in results.items():
        if prompts is not None:
            prompts[row] = result.prompt_logprobs[j]
        if pooled is not None:
            pooled[row] = result.pooled[j]
        for at, s in zip(places[row], sub_rows, strict=True):
            ids[at] = result.next_token_ids[s]
            if result.next_token_logprobs is not None:
                logprobs = logprobs or [0.0] * num_rows
                logprobs[at] = result.next_token_logprobs[s]
            if result.top_logprobs is not None:
                tops = tops or [[] for _ in range(num_rows)]
                tops[at] = result.top_logprobs[s]
    device = batch.forward_batch.input_ids.device
    ids_tensor = torch.tensor(ids, dtype=torch.int64, device=device)
    return GenerationBatchResult(ids, ids_tensor, logprobs, tops, prompts, pooled)


def _fail_all(batch: ScheduleBatch, error: Exception) -> None:
    message = f"forward failed: {type(error).__name__}: {error}"
    batch.row_errors = dict.fromkeys(range(len(batch.reqs)), message)
    n = len(batch.reqs)
    device = batch.forward_batch.input_ids.device if batch.forward_batch is not None else "cpu"
    batch.result = GenerationBatchResult([0] * n, torch.zeros(n, dtype=torch.int64, device=device))
