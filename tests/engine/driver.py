"""A tiny scheduler stand-in for engine tests: allocates pages, fills ``req_to_token``, builds batches.

The real scheduler (``pdserve.scheduler``) does the same bookkeeping with admission, radix
caching and retraction on top; here every sequence simply owns its pages.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pdserve.engine.forward_batch import ForwardBatch, ForwardMode
from pdserve.engine.model_runner import ModelRunner
from pdserve.mem_cache.memory_pool import slots_for_pages
from pdserve.sampling.sampler import GenerationBatchResult
from pdserve.sampling.sampling_batch_info import SamplingBatchInfo
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.sampling.verify import Accepted, VerifyInputs, accept, verify_inputs
from pdserve.speculative.proposer import DraftRequest, Proposer

_RIDS = itertools.count()


@dataclass
class Seq:
    """One sequence: its prompt, outputs, KV pages and how many of its tokens have KV."""

    prompt: list[int]
    params: SamplingParams
    req_pool_idx: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    lora_slot: int = -1  # the LoRA adapter slot (pdserve.lora), -1: the base model
    rid: str = field(default_factory=lambda: f"seq-{next(_RIDS)}")

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt + self.output_ids


class Driver:
    """Runs sequences through a ``ModelRunner`` the way a scheduler would."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.page_size = runner.token_to_kv_pool_allocator.page_size

    def add(self, prompt: list[int], params: SamplingParams | None = None, lora_slot: int = -1) -> Seq:
        idx = self.runner.req_to_token_pool.alloc()
        assert idx is not None, "out of request slots"
        return Seq(list(prompt), params or SamplingParams(temperature=0.0), idx, lora_slot=lora_slot)

    def release(self, *seqs: Seq) -> None:
        for seq in seqs:
            self.runner.token_to_kv_pool_allocator.free(seq.pages)
            self.runner.req_to_token_pool.free(seq.req_pool_idx)
            seq.pages = []

    def prepare(self, work: list[tuple[Seq, int | None]], mode: ForwardMode | None = None) -> ForwardBatch:
        """The batch in which each ``(seq, n)`` computes its next ``n`` uncomputed tokens (all when
        None): allocates pages and writes ``req_to_token`` for them, as a scheduler does."""
        input_ids: list[int] = []
        prefix_lens, extend_lens = [], []
        for seq, n in work:
            fill = seq.fill_ids
            n = len(fill) - seq.num_computed if n is None else n
            start, end = seq.num_computed, seq.num_computed + n
            self._ensure_pages(seq, end)
            input_ids += fill[start:end]
            prefix_lens.append(start)
            extend_lens.append(n)
        seqs = [seq for seq, _ in work]
        params = [seq.params for seq in seqs]
        info = SamplingBatchInfo.build(
            params,
            output_ids=[seq.output_ids for seq in seqs],
            prompt_ids=[seq.prompt for seq in seqs],
            eos_token_ids=self.runner.model_config.eos_token_ids,
            vocab_size=self.runner.model_config.vocab_size,
            device=self.runner.device,
        )
        return ForwardBatch.init_new(
            forward_mode=mode,
            input_ids=input_ids,
            req_pool_indices=[seq.req_pool_idx for seq in seqs],
            seq_lens=[p + e for p, e in zip(prefix_lens, extend_lens, strict=True)],
            extend_prefix_lens=prefix_lens,
            sampling_info=info,
            return_logprob=any(p.return_logprob for p in params),
            top_logprobs_nums=[p.top_logprobs_num for p in params],
            runner=self.runner,
            lora_slots=[seq.lora_slot for seq in seqs],
        )

    def step(
        self, work: list[tuple[Seq, int | None]], mode: ForwardMode | None = None
    ) -> GenerationBatchResult:
        """Run ``prepare(work, mode)``; a sequence whose every token then has KV records the sampled
        token as its next output."""
        fb = self.prepare(work, mode)
        result = self.runner.forward_batch_generation(fb)
        for i, (seq, n) in enumerate(zip([s for s, _ in work], fb.extend_seq_lens.tolist(), strict=True)):
            seq.num_computed += n
            if seq.num_computed == len(seq.fill_ids):
                seq.output_ids.append(result.next_token_ids[i])
                if result.next_token_logprobs is not None:
                    seq.logprobs.append(result.next_token_logprobs[i])
                seq.top_logprobs.append(result.top_logprobs[i] if result.top_logprobs else [])
        return result

    def prepare_verify(
        self, work: list[tuple[Seq, list[int]]], draft_probs: list | None = None
    ) -> tuple[ForwardBatch, VerifyInputs]:
        """The batch in which each ``(seq, drafts)`` computes its uncomputed tokens (its last output)
        followed by ``drafts``, with logits at the last one and at every draft token."""
        seqs = [seq for seq, _ in work]
        inputs = verify_inputs(
            [seq.params for seq in seqs],
            output_ids=[seq.output_ids for seq in seqs],
            prompt_ids=[seq.prompt for seq in seqs],
            drafts=[drafts for _, drafts in work],
            eos_token_ids=self.runner.model_config.eos_token_ids,
            vocab_size=self.runner.model_config.vocab_size,
            device=self.runner.device,
            draft_probs=draft_probs,
        )
        input_ids: list[int] = []
        prefix_lens, extend_lens = [], []
        for seq, drafts in zip(seqs, inputs.drafts, strict=True):
            tokens = seq.fill_ids[seq.num_computed :] + drafts
            self._ensure_pages(seq, seq.num_computed + len(tokens))
            input_ids += tokens
            prefix_lens.append(seq.num_computed)
            extend_lens.append(len(tokens))
        fb = ForwardBatch.init_new(
            input_ids=input_ids,
            req_pool_indices=[seq.req_pool_idx for seq in seqs],
            seq_lens=[p + e for p, e in zip(prefix_lens, extend_lens, strict=True)],
            extend_prefix_lens=prefix_lens,
            logits_lens=inputs.logits_lens,
            sampling_info=inputs.sampling_info,
            return_logprob=any(seq.params.return_logprob for seq in seqs),
            top_logprobs_nums=inputs.top_logprobs_nums,
            draft_rows=inputs.draft_rows,
            runner=self.runner,
        )
        return fb, inputs

    def verify(self, work: list[tuple[Seq, list[int]]], draft_probs: list | None = None) -> list[Accepted]:
        """Run ``prepare_verify(work)``: each sequence keeps its accepted drafts and the token after
        them as outputs, KV for the tokens before that one, and the pages those need."""
        fb, inputs = self.prepare_verify(work, draft_probs)
        accepted = accept(self.runner.forward_batch_generation(fb), inputs.drafts)
        for (seq, _), kept in zip(work, accepted, strict=True):
            seq.num_computed = len(seq.fill_ids) + kept.num_accepted_drafts
            seq.output_ids += kept.token_ids
            seq.logprobs += kept.logprobs or []
            seq.top_logprobs += kept.top_logprobs or [[] for _ in kept.token_ids]
            keep = -(-seq.num_computed // self.page_size)
            self.runner.token_to_kv_pool_allocator.free(seq.pages[keep:])
            del seq.pages[keep:]
        return accepted

    def speculate(self, seqs: list[Seq], proposer: Proposer, num_drafts: int) -> list[Accepted]:
        """One speculative step of ``seqs`` (each with an output: prefilled): up to ``num_drafts``
        drafts from ``proposer``, verified in one forward (``verify``)."""
        reqs = [DraftRequest(s.rid, s.prompt, s.output_ids, num_drafts, s.params) for s in seqs]
        drafts = proposer.propose(reqs)
        return self.verify(list(zip(seqs, drafts.token_ids, strict=True)), drafts.probs)

    def generate(self, seqs: list[Seq], max_new_tokens: int) -> None:
        """Extend every sequence in one batch, then decode them together to ``max_new_tokens`` each."""
        self.step([(seq, None) for seq in seqs])
        for _ in range(max_new_tokens - 1):
            self.step([(seq, None) for seq in seqs])

    def _ensure_pages(self, seq: Seq, num_tokens: int) -> None:
        """Give ``seq`` pages for ``num_tokens`` positions and write their slots into ``req_to_token``."""
        need = -(-num_tokens // self.page_size) - len(seq.pages)
        if need > 0:
            pages = self.runner.token_to_kv_pool_allocator.alloc(need)
            assert pages is not None, "out of KV pages"
            start = len(seq.pages) * self.page_size
            seq.pages += pages
            end = len(seq.pages) * self.page_size
            slots = slots_for_pages(seq.pages, start, end, self.page_size)
            self.runner.req_to_token_pool.req_to_token[seq.req_pool_idx, start:end] = slots
