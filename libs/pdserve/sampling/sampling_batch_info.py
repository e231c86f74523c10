"""``SamplingBatchInfo``: one step's sampling parameters as batched tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.constrained.grammar import Grammar
from pdserve.sampling.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, step) pairs over the seed space


def step_seed(seed: int, step: int) -> int:
    """Seed of the generator a seeded request samples its ``step``-th output token with.

    Stateless in (seed, step), so a request's tokens depend neither on the batch around it nor on
    whether it was retracted and recomputed.
    """
    return (seed * _SEED_MIX + step) % (1 << 63)


@dataclass(slots=True)
class SamplingBatchInfo:
    """Sampling tensors of a batch of ``B`` requests over a vocabulary of ``V`` tokens.

    Attributes:
        temperatures: float32 ``[B, 1]`` (1 for greedy rows, which never divide by it).
        top_ps / min_ps: float32 ``[B]``; top_ks: int64 ``[B]`` (``V`` where disabled, never above ``V``).
        is_greedy: bool ``[B]``; all_greedy: every row is greedy.
        need_top_p / need_top_k / need_min_p: some sampled row uses the filter.
        step_seeds: per row, the generator seed of this step (``step_seed``) or None (global RNG).
        logit_bias: float32 ``[B, V]`` added to the logits (the requests' own ``logit_bias``,
            frequency/presence penalties, ``-inf`` on EOS/stop tokens before ``min_new_tokens``), or
            None when no row needs it.
        repetition_penalties: float32 ``[B, 1]`` and repetition_mask: bool ``[B, V]`` (tokens of the
            prompt or output), or both None when no row penalises repetition.
        grammars: per row its ``Grammar`` (None for unconstrained rows), or None when no row is
            constrained. The sampler reads each grammar's state when it samples (it fills the
            token bitmask then, on the forward thread), so every token the request kept before
            this step must have been accepted by then. The serial loop guarantees that (a step's
            results are processed before the next batch is built). An overlapped loop, which
            builds step N+1 while step N runs, must let the sampler of step N+1 wait until
            ``process_result`` of step N has advanced the matchers (SGLang's overlap scheduler
            waits on an event, ``sampling_info_done``, set by the loop thread after it processed
            the previous step); the forward itself need not wait.
    """

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    is_greedy: torch.Tensor
    all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    step_seeds: list[int | None]
    logit_bias: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    repetition_mask: torch.Tensor | None
    vocab_size: int
    grammars: list[Grammar | None] | None = None

    @property
    def argmax_only(self) -> bool:
        """Every row's token is the argmax of its raw logits: all greedy, no penalty, bias, ban or grammar."""
        return (
            self.all_greedy
            and self.logit_bias is None
            and self.repetition_mask is None
            and self.grammars is None
        )

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_ids: list[list[int]],
        prompt_ids: list[list[int]],
        eos_token_ids: list[int],
        vocab_size: int,
        device: str | torch.device = "cpu",
        grammars: list[Grammar | None] | None = None,
        output_lens: list[int] | None = None,
    ) -> SamplingBatchInfo:
        """Build from each request's params, its output so far, its prompt and its grammar (same order).

        ``output_lens`` (default: the lengths of ``output_ids``) counts each request's outputs before
        this step's token, also those sampled by a step whose result is not known yet; they set
        seeds and ``min_new_tokens`` bans. Penalties read ``output_ids`` itself, which must then be
        complete (the scheduler waits for pending tokens of a penalised request).

        Requests are validated on admission (``SamplingParams.validate``); as defence in depth,
        ``top_k`` is clamped to the vocabulary and token ids outside it are ignored here, so that one
        request can never fail the whole batch's step.
        """
        batch = len(params)
        lens = output_lens if output_lens is not None else [len(out) for out in output_ids]
        greedy = [p.is_greedy for p in params]
        sampled = [p for p, g in zip(params, greedy, strict=True) if not g]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        def in_vocab(ids: list[int]) -> list[int]:
            return [t for t in ids if 0 <= t < vocab_size]

        penalised = any(p.has_penalties for p in params)
        banned = [
            (i, in_vocab(([] if p.ignore_eos else list(eos_token_ids)) + list(p.stop_token_ids)))
            for i, p in enumerate(params)
            if lens[i] < p.min_new_tokens
        ]
        biased = [
            (i, {t: p.logit_bias[t] for t in in_vocab(list(p.logit_bias))})
            for i, p in enumerate(params)
            if p.logit_bias
        ]
        logit_bias = None
        if penalised or banned or biased:
            logit_bias = torch.zeros((batch, vocab_size), dtype=torch.float32, device=device)
            for row, bias in biased:
                logit_bias[row, list(bias)] = tensor(list(bias.values()), torch.float32)
            if penalised:
                counts = _token_counts(output_ids, batch, vocab_size, device)
                freq = tensor([p.frequency_penalty for p in params], torch.float32)[:, None]
                pres = tensor([p.presence_penalty for p in params], torch.float32)[:, None]
                logit_bias -= freq * counts + pres * (counts > 0)
            for row, ids in banned:
                logit_bias[row, ids] = float("-inf")
        repetition_penalties = repetition_mask = None
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition_penalties = tensor([p.repetition_penalty for p in params], torch.float32)[:, None]
            seen = [prompt + out for prompt, out in zip(prompt_ids, output_ids, strict=True)]
            repetition_mask = _token_counts(seen, batch, vocab_size, device) > 0
        return cls(
            temperatures=tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], torch.float32
            )[:, None],
            top_ps=tensor([p.top_p for p in params], torch.float32),
            top_ks=tensor(
                [min(p.top_k, vocab_size) if p.top_k_enabled else vocab_size for p in params], torch.int64
            ),
            min_ps=tensor([p.min_p for p in params], torch.float32),
            is_greedy=tensor(greedy, torch.bool),
            all_greedy=all(greedy),
            need_top_p=any(p.top_p < 1.0 for p in sampled),
            need_top_k=any(p.top_k_enabled for p in sampled),
            need_min_p=any(p.min_p > 0.0 for p in sampled),
            step_seeds=[
                None if p.seed is None else step_seed(p.seed, n) for p, n in zip(params, lens, strict=True)
            ],
            logit_bias=logit_bias,
            repetition_penalties=repetition_penalties,
            repetition_mask=repetition_mask,
            vocab_size=vocab_size,
            grammars=grammars if grammars and any(g is not None for g in grammars) else None,
        )

    def select(self, rows: list[int]) -> SamplingBatchInfo:
        """The sampling tensors of ``rows`` (in that order) alone, as ``build`` would make them for
        those requests: a forward over part of a batch samples each of them as the whole batch would."""
        idx = torch.tensor(rows, dtype=torch.int64, device=self.temperatures.device)
        is_greedy = self.is_greedy[idx]
        sampled = ~is_greedy

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[idx]

        return SamplingBatchInfo(
            temperatures=self.temperatures[idx],
            top_ps=self.top_ps[idx],
            top_ks=self.top_ks[idx],
            min_ps=self.min_ps[idx],
            is_greedy=is_greedy,
            all_greedy=bool(is_greedy.all()),
            need_top_p=bool((self.top_ps[idx][sampled] < 1.0).any()),
            need_top_k=bool((self.top_ks[idx][sampled] != self.vocab_size).any()),
            need_min_p=bool((self.min_ps[idx][sampled] > 0.0).any()),
            step_seeds=[self.step_seeds[i] for i in rows],
            logit_bias=pick(self.logit_bias),
            repetition_penalties=pick(self.repetition_penalties),
            repetition_mask=pick(self.repetition_mask),
            vocab_size=self.vocab_size,
            grammars=[self.grammars[i] for i in rows] if self.grammars is not None else None,
        )


def _token_counts(
    ids: list[list[int]], batch: int, vocab_size: int, device: str | torch.device
) -> torch.Tensor:
    """float32 ``[batch, vocab_size]``: how often each token occurs in each row of ``ids``."""
    counts = torch.zeros((batch, vocab_size), dtype=torch.float32, device=device)
    lengths = torch.tensor([len(row) for row in ids], device=device)
    rows = torch.repeat_interleave(torch.arange(batch, device=device), lengths)
    flat = torch.tensor([t for row in ids for t in row], dtype=torch.int64, device=device)
    counts.index_put_((rows, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)
    return counts
