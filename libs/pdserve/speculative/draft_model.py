"""Drafting with a smaller model of the same tokenizer (Leviathan et al. 2023; Chen et al. 2023).

The draft model is a ``ModelRunner`` of its own in the target's worker, with its own small KV pool
(``DraftKV``). Each step it catches up with the request's verified tokens (keeping the KV of the
longest prefix it holds that was verified, freeing the rest: rejected drafts' slots go back), then
decodes ``k`` tokens one at a time: greedy requests take the draft's argmax (a point mass, so the
target keeps the argmax chain it agrees with); sampled ones sample the draft's own distribution
``q`` under the request's temperature and top-k / top-p / min-p, returned for the rejection rule.

The request's outputs (and its prompt, once) enter the draft's KV as the target computed them:
prompts as an extend, later tokens as decode-kernel rows (``logits_lens``), so a draft of the
target's own checkpoint and settings reproduces the target's logits and every greedy draft stands.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.model_runner import ModelRunner
from pdserve.sampling.sampler import target_probs
from pdserve.sampling.sampling_batch_info import SamplingBatchInfo, step_seed
from pdserve.sampling.uniforms import uniforms
from pdserve.speculative.draft_kv import DraftKV, DraftSeq
from pdserve.speculative.proposer import DraftRequest, Drafts, Proposer
from pdserve.speculative.vocabulary import check_same_vocabulary

_DRAFT_SALT = 0x4F1BBCDCBFA53E0B  # a seeded request's draft numbers differ from its own sampling's


class DraftModelProposer(Proposer):
    """Drafts with ``runner``, a draft model's ``ModelRunner`` (build it with ``load``)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.kv = DraftKV(runner)

    @classmethod
    def load(cls, draft_path: str | Path, target_path: str | Path, **runner_args) -> DraftModelProposer:
        """The draft checkpoint at ``draft_path`` in a ``ModelRunner`` of ``runner_args`` (dtype,
        quantization, pool size: ``max_total_tokens`` of the draft's own pool, request slots).

        Raises:
            ValueError: its tokenizer or vocabulary differs from ``target_path``'s (both named).
        """
        check_same_vocabulary(target_path, draft_path)
        return cls(ModelRunner(Path(draft_path), **runner_args))

    def release(self, rid: str) -> None:
        self.kv.release(rid)

    @torch.inference_mode()
    def propose(self, reqs: Sequence[DraftRequest]) -> Drafts:
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor] | None] = [None] * len(reqs)
        work: list[tuple[int, DraftRequest, DraftSeq]] = []
        for i, req in enumerate(reqs):
            seq = self.kv.get(req.rid)
            if seq is None:
                continue  # no draft slot free: this request verifies nothing this step
            self.kv.sync(seq, req.prompt_ids, req.output_ids)
            total = len(req.prompt_ids) + len(req.output_ids)
            if self.kv.reserve(seq, total + req.num_drafts - 1):
                work.append((i, req, seq))
        if not work:
            return Drafts(drafts)
        # the verified tokens the draft lacks: the prompt's as an extend, the rest (at least the last
        # token, whose logits give d_0) as decode rows, as the target computed them
        prefill, rows = [], []
        for _, req, seq in work:
            total = len(req.prompt_ids) + len(req.output_ids)
            split = max(seq.num_verified, min(len(req.prompt_ids), total - 1))
            if split > seq.num_verified:
                prefill.append((seq, _tokens(req, seq.num_verified, split)))
            rows.append((seq, _tokens(req, split, total)))
        if prefill:
            self._forward(prefill, as_rows=False, verified=True)
        logits = self._forward(rows, as_rows=True, verified=True)
        for j in range(max(req.num_drafts for _, req, _ in work)):
            if j:  # decode d_{j-1} of the requests that want more
                work = [(i, req, seq) for i, req, seq in work if j < req.num_drafts]
                steps = [(seq, drafts[i][-1:]) for i, _, seq in work]
                logits = self._forward(steps, as_rows=False, verified=False)
            tokens, qs = self._draw(logits, [req for _, req, _ in work], j)
            for (i, _, _), token, q in zip(work, tokens, qs, strict=True):
                drafts[i].append(token)
                if q is not None:
                    probs[i] = (probs[i] or []) + [q]
        return Drafts(drafts, [None if p is None else torch.stack(p) for p in probs])

    def _forward(self, work: list[tuple[DraftSeq, list[int]]], as_rows: bool, verified: bool) -> torch.Tensor:
        """Compute KV for ``tokens`` after each ``seq``'s (appended to its ``ids``, and counted as
        verified if they are): as an extend, or (``as_rows``) each token as a decode row. Logits
        ``[len(work), V]`` of each request's last token."""
        prefix = [len(seq.ids) for seq, _ in work]
        lens = [len(tokens) for _, tokens in work]
        fb = ForwardBatch.init_new(
            input_ids=[t for _, tokens in work for t in tokens],
            req_pool_indices=[seq.slot for seq, _ in work],
            seq_lens=[p + n for p, n in zip(prefix, lens, strict=True)],
            extend_prefix_lens=prefix,
            logits_lens=lens if as_rows else None,
            runner=self.runner,
        )
        logits = self.runner.forward_logits(fb)
        for seq, tokens in work:
            seq.ids += tokens
            if verified:
                seq.num_verified = len(seq.ids)
        return logits[torch.cumsum(fb.logits_lens, 0) - 1] if as_rows else logits

    def _draw(
        self, logits: torch.Tensor, reqs: list[DraftRequest], j: int
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Draft token ``j`` of each request from its logits row: the argmax for greedy requests
        (no ``q``); a sample of ``q`` (temperature and filters on the draft's logits, float32 ``[V]``)
        for the others, from a generator of the request's seed and position where it has a seed."""
        tokens = logits.argmax(dim=-1)
        qs: list[torch.Tensor | None] = [None] * len(reqs)
        rows = [r for r, req in enumerate(reqs) if not req.sampling_params.is_greedy]
        if rows:
            params = [reqs[r].sampling_params for r in rows]
            vocab = logits.shape[-1]
            info = SamplingBatchInfo.build(
                params, [[]] * len(rows), [[]] * len(rows), [], vocab, logits.device
            )
            q = target_probs(logits[rows].float(), info, torch.arange(len(rows), device=logits.device))
            seeds = [
                None if p.seed is None else step_seed(p.seed, len(reqs[r].output_ids) + j) ^ _DRAFT_SALT
                for r, p in zip(rows, params, strict=True)
            ]
            cdf = q.cumsum(dim=-1)
            u = uniforms(seeds, logits.device)[:, None] * cdf[:, -1:]
            tokens[rows] = torch.searchsorted(cdf, u, right=True).clamp_(max=vocab - 1).squeeze(1)
            for r, row in zip(rows, q, strict=True):
                qs[r] = row
        return tokens.tolist(), qs


def _tokens(req: DraftRequest, start: int, end: int) -> list[int]:
    """Positions ``[start, end)`` of ``req``'s verified sequence (prompt, then outputs)."""
    n = len(req.prompt_ids)
    return list(req.prompt_ids[start:end]) + list(req.output_ids[max(start - n, 0) : max(end - n, 0)])
