"""Benchmark workloads on the real SmolLM2 tokenizer: prompt lengths, distinctness, a truly shared prefix."""

from __future__ import annotations

import random

import pytest

from benchmarks.serving_lib.grounded import TASKS
from benchmarks.serving_lib.tokens import estimate_tokens
from benchmarks.serving_lib.workload import WORDS, PromptSource, random_words
from tests.reference import hf_tokenizer


def n_tokens(text: str) -> int:
    return len(hf_tokenizer()(text)["input_ids"])


@pytest.mark.parametrize("target", [16, 128, 512])
def test_random_prompts_have_about_the_asked_token_count(target):
    prompts = PromptSource("random", target, 1000, seed=1).take(8)
    counts = [n_tokens(p) for p in prompts]
    assert all(abs(c - target) <= max(2, 0.1 * target) for c in counts), counts


def test_calibrated_tokens_per_word_hits_the_target():
    sample = random_words(random.Random(7), 400)
    tokens_per_word = n_tokens(sample) / 400
    prompts = PromptSource("random", 256, 1000, seed=3, tokens_per_word=tokens_per_word).take(6)
    assert all(abs(n_tokens(p) - 256) <= 0.05 * 256 for p in prompts)


def test_random_prompts_are_fresh_and_reproducible():
    a = PromptSource("random", 64, 1000, seed=5)
    first, second = a.take(10), a.take(10)
    assert len(set(first + second)) == 20
    b = PromptSource("random", 64, 1000, seed=5)
    assert b.take(20) == first + second
    assert PromptSource("random", 64, 1000, seed=6).take(10) != first
    assert all(set(p.split()) <= set(WORDS) for p in first)


def test_shared_prefix_prompts_share_the_preamble_tokens():
    source = PromptSource("shared-prefix", 128, 1000, seed=0)
    prompts = source.take(6) + source.take(6)
    [preamble] = source.preambles
    preamble_ids = hf_tokenizer()(preamble)["input_ids"]
    assert abs(len(preamble_ids) - 1000) <= 50
    assert len(set(prompts)) == len(prompts)
    for prompt in prompts:
        assert prompt.startswith(preamble)
        ids = hf_tokenizer()(prompt)["input_ids"]
        # the radix cache matches token ids, so the shared part must survive tokenization intact
        assert ids[: len(preamble_ids)] == preamble_ids
        assert 5 < len(ids) - len(preamble_ids) < 40
    assert PromptSource("shared-prefix", 128, 1000, seed=0).preambles == [preamble]


def test_tenants_prompts_start_with_their_tenants_preamble_in_random_order():
    source = PromptSource("tenants", 128, 200, seed=0, tenants=4)
    assert len(set(source.preambles)) == 4
    prompts = source.take(64)
    owners = [[i for i, p in enumerate(source.preambles) if prompt.startswith(p)] for prompt in prompts]
    assert all(len(o) == 1 for o in owners)  # each prompt is exactly one tenant's
    order = [o[0] for o in owners]
    assert set(order) == {0, 1, 2, 3} and order != sorted(order)
    assert PromptSource("tenants", 128, 200, seed=0, tenants=4).take(64) == prompts


def test_estimate_is_close_to_the_real_count():
    source = PromptSource("shared-prefix", 128, 300, seed=2)
    for prompt in source.take(3) + PromptSource("random", 200, 1000, seed=2).take(3):
        assert abs(estimate_tokens(prompt) - n_tokens(prompt)) <= 0.05 * n_tokens(prompt)


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        PromptSource("sonnets", 128, 1000, seed=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PromptSource("random", 0, 1000, seed=0)


def test_grounded_prompts_hold_what_their_answers_copy():
    """Each task in turn (repeat, extract, replace, rename), its grounding text about the asked length,
    the prompts the same for the same seed."""
    source = PromptSource("grounded", 120, 1, seed=4)
    prompts = source.take(8)
    assert prompts == PromptSource("grounded", 120, 1, seed=4).take(8)
    assert len(set(prompts)) == 8
    for i, prompt in enumerate(prompts):
        task = TASKS[i % len(TASKS)]
        head = {
            "repeat": "Here is a passage:",
            "extract": "Notes:",
            "replace": "Text:",
            "rename": "```python",
        }[task]
        assert prompt.startswith(head)
        assert 90 <= n_tokens(prompt) <= 260, (task, n_tokens(prompt))
    _, note, _ = prompts[1].rpartition("Note ")[2].partition(", which mentions the ")
    number = int(prompts[1].rpartition("Note ")[2].split(",")[0])
    quoted = prompts[1].split("\n")[number]  # the notes are numbered from the second line
    assert quoted.startswith(f"{number}. ") and note.split(",")[0] in quoted.lower()
    assert "def " in prompts[3] and prompts[3].count("renamed to") == 1
