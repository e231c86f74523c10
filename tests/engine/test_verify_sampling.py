"""Acceptance of draft tokens (speculative decoding) in the sampler: each verify row samples as
non-speculative decoding samples that position (penalties, bans, bias, seeds and grammar advanced
along the draft), greedy requests keep exactly the argmax chain, and sampled outputs keep the
target's distribution (chi-square over thousands of draws, with a test of its power)."""

from __future__ import annotations

import pytest
import torch

from pdserve.sampling.sampler import Sampler, target_probs
from pdserve.sampling.sampling_batch_info import SamplingBatchInfo
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.sampling.verify import accept, verify_inputs

VOCAB = 8
EOS = 7


def verify(logits: torch.Tensor, params, drafts, outputs=None, draft_probs=None, prompts=None, grammars=None):
    """The verify inputs and the sampler's result for rows ``logits`` (``[sum(k_i + 1), V]``)."""
    n = len(params)
    inputs = verify_inputs(
        params,
        output_ids=outputs or [[] for _ in range(n)],
        prompt_ids=prompts or [[1] for _ in range(n)],
        drafts=drafts,
        eos_token_ids=[EOS],
        vocab_size=VOCAB,
        grammars=grammars,
        draft_probs=draft_probs,
    )
    result = Sampler()(
        logits,
        inputs.sampling_info,
        return_logprob=True,
        top_logprobs_nums=inputs.top_logprobs_nums,
        drafts=inputs.draft_rows,
    )
    return inputs, result


def one_at_a_time(logits: torch.Tensor, params: SamplingParams, output: list[int], tokens: list[int]):
    """The samples of non-speculative decoding at each row, the output growing by ``tokens``."""
    samples = []
    for j, row in enumerate(logits):
        info = SamplingBatchInfo.build([params], [output + tokens[:j]], [[1]], [EOS], VOCAB)
        samples.append(Sampler()(row[None].clone(), info, return_logprob=True, top_logprobs_nums=[3]))
    return samples


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5, logit_bias={3: 2.0}),
        SamplingParams(temperature=0.0, min_new_tokens=3, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=5, seed=11, frequency_penalty=0.7),
        SamplingParams(temperature=1.3, min_p=0.05, seed=-5, min_new_tokens=2, top_logprobs_num=3),
    ],
)
def test_rows_sample_as_decoding_one_token_at_a_time(params):
    """Penalties count the draft as output, min_new_tokens bans EOS by position, seeds follow the
    position: every row's token, logprob and top logprobs equal non-speculative decoding's."""
    torch.manual_seed(0)
    params.top_logprobs_num = 3
    logits = torch.randn(6, VOCAB) * 2
    logits[:, EOS] += 1.0
    output = [2, 2]
    draft = [4, 2, EOS, 4, 1]
    _, result = verify(logits, [params], [draft], outputs=[output])
    expected = one_at_a_time(logits, params, output, draft)
    assert result.next_token_ids == [r.next_token_ids[0] for r in expected]
    assert result.next_token_logprobs == [r.next_token_logprobs[0] for r in expected]
    assert result.top_logprobs == [r.top_logprobs[0] for r in expected]


def test_greedy_keeps_the_argmax_chain_then_corrects():
    logits = torch.full((4 + 3, VOCAB), -5.0)
    for row, token in enumerate([3, 1, 4, 1, 5, 6, 6]):
        logits[row, token] = 5.0
    greedy = SamplingParams(temperature=0.0)
    inputs, result = verify(logits, [greedy, greedy], [[3, 1, 0], [5, 6]])
    kept = accept(result, inputs.drafts)
    assert [k.token_ids for k in kept] == [[3, 1, 4], [5, 6, 6]]  # a mismatch at d_2; all + the bonus
    assert [k.num_accepted_drafts for k in kept] == [2, 2]
    assert kept[0].logprobs == result.next_token_logprobs[:3]


def test_a_seeded_request_keeps_its_non_speculative_tokens():
    """Deterministic drafts: each row samples with its position's step seed, so the kept tokens are the
    ones the same seed gives without speculation, whatever the draft guessed."""
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    torch.manual_seed(3)
    chain = torch.randn(VOCAB, VOCAB)  # a toy model: logits of the next token given the last one
    output = [0]
    plain = list(output)
    for _ in range(12):
        info = SamplingBatchInfo.build([params], [plain], [[1]], [EOS], VOCAB)
        plain.append(Sampler()(chain[plain[-1]][None].clone(), info).next_token_ids[0])
    spec = list(output)
    while len(spec) < len(plain):
        draft = [(spec[-1] + 1 + j) % VOCAB for j in range(3)]  # guesses, some right by chance
        logits = chain[[spec[-1], *draft]]
        inputs, result = verify(logits, [params], [draft], outputs=[spec])
        spec += accept(result, inputs.drafts)[0].token_ids
    assert spec[: len(plain)] == plain


def markov_outputs(
    target: torch.Tensor, draft: torch.Tensor, params: SamplingParams, requests: int, k: int, sampled: bool
) -> torch.Tensor:
    """int64 ``[requests, 2]``: the first two tokens each request keeps from verify steps over a toy
    Markov model (``target[t]``: logits of the token after ``t``), drafting ``k`` tokens a step from the
    chain ``draft`` (probabilities): sampled from it (with ``q``) or its argmax (a point mass)."""
    last = torch.zeros(requests, dtype=torch.int64)
    outputs: list[list[int]] = [[] for _ in range(requests)]
    active = list(range(requests))
    while active:
        prev = last[active]
        tokens, probs = [], []
        for _ in range(k):
            q = draft[prev]
            nxt = torch.multinomial(q, 1).squeeze(1) if sampled else q.argmax(-1)
            tokens.append(nxt)
            probs.append(q)
            prev = nxt
        drafts = torch.stack(tokens, 1).tolist()
        qs = list(torch.stack(probs, 1).unbind(0)) if sampled else None
        rows = torch.cat([last[active, None], torch.tensor(drafts)], 1)  # [n, k + 1]: each row's context
        logits = target[rows.reshape(-1)]
        n = len(active)
        outs = [outputs[i] for i in active]
        inputs, result = verify(logits, [params] * n, drafts, outputs=outs, draft_probs=qs)
        for i, kept in zip(active, accept(result, inputs.drafts), strict=True):
            outputs[i] += kept.token_ids
            last[i] = outputs[i][-1]
        active = [i for i in active if len(outputs[i]) < 2]
    return torch.tensor([out[:2] for out in outputs])


def chi_square_pvalue(pairs: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of the ``[n, 2]`` token pairs against the joint
    probabilities ``expected`` ``[V, V]``; cells the target never produces must be empty."""
    counts = torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB).double()
    expected = expected.reshape(-1).double() * len(pairs)
    assert counts[expected == 0].sum() == 0, "a token the target filters out came out"
    live = expected > 0
    stat = ((counts[live] - expected[live]) ** 2 / expected[live]).sum()
    df = int(live.sum()) - 1
    return float(1 - torch.distributions.Chi2(torch.tensor(float(df))).cdf(stat))


@pytest.mark.parametrize("sampled", [True, False], ids=["draft-samples-q", "point-mass-draft"])
def test_outputs_keep_the_target_distribution(sampled):
    """20,000 requests at temperature 1 with top-p 0.9 over a toy Markov target and another chain as
    the draft: the joint distribution of each request's first two kept tokens is the target's
    (chi-square p > 0.001 over its 36 possible pairs, fixed seeds: 0.26 and 0.17); the same samples
    against the target mixed 9:1 with a uniform distribution over its support are refused
    (p < 1e-9), so the test has the power to see such an error."""
    torch.manual_seed(0)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    target = torch.randn(VOCAB, VOCAB)
    draft = torch.softmax(torch.randn(VOCAB, VOCAB), -1)
    info = SamplingBatchInfo.build([params] * VOCAB, [[]] * VOCAB, [[1]] * VOCAB, [], VOCAB)
    p = target_probs(target.clone(), info, torch.arange(VOCAB))  # [V, V]: top-p filtered, renormalised
    assert (p == 0).any()  # top-p cuts tokens the draft proposes
    joint = p[0][:, None] * p  # the first token after token 0, then the one after it
    pairs = markov_outputs(target, draft, params, 20_000, k=3, sampled=sampled)
    assert int((joint > 0).sum()) == 36
    assert chi_square_pvalue(pairs, joint) > 1e-3
    support = (joint > 0).double()
    assert chi_square_pvalue(pairs, 0.9 * joint + 0.1 * support / support.sum()) < 1e-9
