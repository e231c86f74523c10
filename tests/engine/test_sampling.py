"""Sampling: validation, filters, penalties, min_new_tokens, logprobs, and seeded reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.sampling.sampler import Sampler
from pdserve.sampling.sampling_batch_info import SamplingBatchInfo
from pdserve.sampling.sampling_params import SamplingParams
from tests.engine.driver import Driver

VOCAB = 8
EOS = 7


def sample(logits: list[list[float]], params: list[SamplingParams], outputs=None, prompts=None, **kw):
    rows = len(params)
    info = SamplingBatchInfo.build(
        params,
        output_ids=outputs or [[] for _ in range(rows)],
        prompt_ids=prompts or [[] for _ in range(rows)],
        eos_token_ids=[EOS],
        vocab_size=VOCAB,
    )
    return Sampler()(torch.tensor(logits, dtype=torch.float32), info, **kw)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3.0),
        ("max_new_tokens", 0),
        ("min_new_tokens", 500),
        ("n", 0),
        ("top_logprobs_num", 21),
        ("stop_token_ids", [-1]),
        ("stop", [""]),
        ("seed", "7"),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {3: 100.5}),
        ("logit_bias", {3: float("nan")}),
    ],
)
def test_validation_names_the_bad_field(field, value):
    SamplingParams().validate()
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()


def test_logit_bias_keys_are_checked_against_the_vocabulary():
    SamplingParams(logit_bias={VOCAB - 1: -100.0}).validate(VOCAB)
    with pytest.raises(ValueError, match=r"logit_bias names token id 8, outside the vocabulary \[0, 8\)"):
        SamplingParams(logit_bias={VOCAB: 1.0}).validate(VOCAB)


def test_a_request_past_the_bounds_never_fails_the_batch():
    """Defence in depth (requests are validated on admission): ``top_k`` above the vocabulary is
    clamped and stop / bias ids outside it are ignored, so the batch-mates get their tokens."""
    logits = [[0.0, 2.0, 1.9, -1.0, 0.0, 0.0, 0.0, 3.0]] * 3
    greedy = SamplingParams(temperature=0.0)
    huge_k = SamplingParams(temperature=1.0, top_k=10**9)
    stray_ids = SamplingParams(
        temperature=0.0, min_new_tokens=2, stop_token_ids=[VOCAB, 2**31], logit_bias={1: 50.0, VOCAB + 5: 9.0}
    )
    out = sample(logits, [greedy, huge_k, stray_ids], top_logprobs_nums=[3, 0, 0], return_logprob=True)
    assert out.next_token_ids[0] == EOS and out.next_token_ids[2] == 1
    assert 0 <= out.next_token_ids[1] < VOCAB
    wide = sample(logits[:1], [SamplingParams(top_logprobs_num=20)], top_logprobs_nums=[20])
    assert len(wide.top_logprobs[0]) == VOCAB  # 20 asked of a vocabulary of 8


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-6])
def test_a_temperature_below_the_epsilon_is_greedy(temperature):
    """vLLM's rule (``_SAMPLING_EPS`` 1e-5): dividing by 1e-40 overflowed the logits to inf and
    softmax gave NaN, so any token came out."""
    params = SamplingParams(temperature=temperature)
    assert params.is_greedy
    logits = [[0.0, 2.0, 1.9, -1.0, 0.0, 0.0, 0.0, 3.0], [0.5, 0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0]]
    assert sample(logits * 50, [params] * 100).next_token_ids == [EOS, 4] * 50
    assert not SamplingParams(temperature=1e-5).is_greedy


def test_filters_restrict_the_candidates():
    logits = [math.log(p) for p in (0.05, 0.5, 0.3, 0.1, 0.05, 0.0001, 0.0001, 0.0001)]
    many = 400
    cases = [
        ((1,), SamplingParams(temperature=1.0, top_k=1)),
        ((1, 2), SamplingParams(temperature=1.0, top_k=2)),
        ((1, 2, 3), SamplingParams(temperature=1.0, top_p=0.85)),  # 0.5 + 0.3 < 0.85 <= 0.9
        ((1, 2), SamplingParams(temperature=1.0, min_p=0.5)),  # keeps p >= 0.25
    ]
    for allowed, params in cases:
        tokens = sample([logits] * many, [params] * many).next_token_ids
        assert set(tokens) <= set(allowed) and len(set(tokens)) == len(allowed)


def test_sampled_frequencies_follow_the_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.2, 0, 0, 0, 0, 0])
    logits = torch.log(probs.clamp_min(1e-30)).tolist()
    many = 6000
    tokens = torch.tensor(sample([logits] * many, [SamplingParams(temperature=1.0)] * many).next_token_ids)
    freq = torch.bincount(tokens, minlength=VOCAB).float() / many
    assert torch.allclose(freq, probs, atol=0.03)
    # temperature 0.5 squares the odds: p ∝ p_i^2
    tokens = torch.tensor(sample([logits] * many, [SamplingParams(temperature=0.5)] * many).next_token_ids)
    freq = torch.bincount(tokens, minlength=VOCAB).float() / many
    assert torch.allclose(freq, probs**2 / (probs**2).sum(), atol=0.03)


def test_penalties_and_min_new_tokens_change_greedy_choice():
    logits = [[0.0, 2.0, 1.9, -1.0, 0.0, 0.0, 0.0, 3.0]]  # EOS (7) on top, then 1, then 2
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [greedy]).next_token_ids == [EOS]
    min_tokens = SamplingParams(temperature=0.0, min_new_tokens=2)
    assert sample(logits, [min_tokens], outputs=[[1]]).next_token_ids == [1]
    assert sample(logits, [min_tokens], outputs=[[1, 1]]).next_token_ids == [EOS]
    ignore = SamplingParams(temperature=0.0, min_new_tokens=2, ignore_eos=True, stop_token_ids=[1])
    assert sample(logits, [ignore], outputs=[[4]]).next_token_ids == [EOS]
    no_eos = [[0.0, 2.0, 1.9, -1.0, 0.0, 0.0, 0.0, -5.0]]
    assert sample(no_eos, [ignore], outputs=[[4]]).next_token_ids == [2]  # stop token 1 masked
    # frequency: 2.0 - 0.1*2 < 1.9; presence: 2.0 - 0.2 < 1.9; repetition: 2.0/1.1 < 1.9 (token in prompt)
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.1)
    assert sample(no_eos, [freq], outputs=[[1, 1]]).next_token_ids == [2]
    assert sample(no_eos, [freq], outputs=[[1]]).next_token_ids == [1]
    pres = SamplingParams(temperature=0.0, presence_penalty=0.2)
    assert sample(no_eos, [pres], outputs=[[1]]).next_token_ids == [2]
    rep = SamplingParams(temperature=0.0, repetition_penalty=1.1)
    assert sample(no_eos, [rep], prompts=[[1]]).next_token_ids == [2]
    neg = [[-2.0, -1.0, -1.05, -9.0, -9.0, -9.0, -9.0, -9.0]]  # negative logits are multiplied
    assert sample(neg, [rep], prompts=[[1]]).next_token_ids == [2]


def test_logit_bias_is_added_per_request_before_sampling():
    logits = [[0.0, 2.0, 1.9, -1.0, 0.0, 0.0, 0.0, -5.0]] * 3
    plain = SamplingParams(temperature=0.0)
    nudged = SamplingParams(temperature=0.0, logit_bias={2: 0.2})  # 1.9 + 0.2 > 2.0
    banned = SamplingParams(temperature=0.0, logit_bias={1: -100.0, 2: -100.0})
    out = sample(logits, [plain, nudged, banned], return_logprob=True)
    assert out.next_token_ids == [1, 2, 0]  # each row only its own bias; 0 ties 4-6 and comes first
    raw = torch.log_softmax(torch.tensor(logits[0]), -1)
    assert out.next_token_logprobs == pytest.approx(raw[[1, 2, 0]].tolist(), abs=1e-6)  # unbiased
    # +100 all but forces a token, also when sampling
    forced = SamplingParams(temperature=1.0, logit_bias={3: 100.0})
    assert set(sample(logits * 100, [forced] * 300).next_token_ids) == {3}
    # the bias adds to the penalties' bias, and a min_new_tokens ban still wins over it
    both = SamplingParams(temperature=0.0, frequency_penalty=0.1, min_new_tokens=1, logit_bias={7: 100.0})
    assert sample(logits[:1], [both], outputs=[[]]).next_token_ids == [1]
    assert sample(logits[:1], [both], outputs=[[7]]).next_token_ids == [7]


def test_logprobs_come_from_the_raw_distribution():
    logits = [[0.1, 2.0, 1.0, -1.0, 0.5, 0.0, 0.3, 1.5], [3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    params = [SamplingParams(temperature=0.0, top_logprobs_num=3), SamplingParams(temperature=0.7, top_k=1)]
    out = sample(logits, params, return_logprob=True, top_logprobs_nums=[3, 0])
    raw = torch.log_softmax(torch.tensor(logits), -1)
    assert out.next_token_ids == [1, 0]
    assert out.next_token_logprobs == pytest.approx([raw[0, 1].item(), raw[1, 0].item()], abs=1e-6)
    top = out.top_logprobs[0]
    assert [t for t, _ in top] == [1, 7, 2]
    assert [lp for _, lp in top] == pytest.approx(raw[0, [1, 7, 2]].tolist(), abs=1e-6)
    assert out.top_logprobs[1] == []


def test_seeded_request_is_reproducible_inside_any_batch(runner, tokenizer, long_text):
    ids = tokenizer(long_text)["input_ids"]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    driver = Driver(runner)
    alone = driver.add(ids[:40], seeded)
    driver.generate([alone], 12)
    driver.release(alone)

    temperatures = [0.0, 1.0, 1.3, 0.7]
    others = [
        SamplingParams(temperature=temperatures[i % 4], seed=None if i % 3 else i, frequency_penalty=0.2)
        for i in range(16)
    ]
    again = driver.add(ids[:40], seeded)
    crowd = [driver.add(ids[50 + 9 * i : 50 + 9 * i + 5 + 3 * i], p) for i, p in enumerate(others)]
    driver.generate([*crowd[:7], again, *crowd[7:]], 12)
    driver.release(again, *crowd)
    assert again.output_ids == alone.output_ids

    other_seed = driver.add(ids[:40], SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=99))
    driver.generate([other_seed], 12)
    driver.release(other_seed)
    assert other_seed.output_ids != alone.output_ids
