"""Drafting with a model: the target as its own draft (every greedy draft stands), a tiny random
checkpoint of the same tokenizer (most drafts fall, outputs unchanged), the draft's own KV pool kept
in step and emptied, and drafts of another vocabulary refused at load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from benchmarks.serving_lib.tiny_model import tiny_checkpoint
from pdserve.engine.model_runner import ModelRunner
from pdserve.model_source import resolve_model
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.speculative.draft_model import DraftModelProposer
from tests.engine.driver import Driver
from tests.reference import hf_tokenizer

NEW_TOKENS = 24
RUNNER = dict(dtype="float32", quantization="w4a8", max_total_tokens=4096, max_running_requests=8)


@pytest.fixture(scope="module")
def target() -> ModelRunner:
    torch.set_num_threads(1)
    return ModelRunner(resolve_model(), **RUNNER)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    if n < 2:\n        return n\n",
        "Write a short poem about the sea and the wind:",
    ]
    return [hf_tokenizer().encode(t) for t in texts]


def plain(target: ModelRunner, prompts, params: SamplingParams) -> list[list[int]]:
    driver = Driver(target)
    seqs = [driver.add(p, params) for p in prompts]
    driver.generate(seqs, NEW_TOKENS)
    driver.release(*seqs)
    return [s.output_ids for s in seqs]


def speculative(target, proposer, prompts, params, k: int) -> tuple[list[list[int]], list[int]]:
    """Outputs (the first ``NEW_TOKENS`` of each) and the drafts accepted per step and request."""
    driver = Driver(target)
    seqs = [driver.add(p, params) for p in prompts]
    driver.step([(s, None) for s in seqs])
    accepted = []
    while min(len(s.output_ids) for s in seqs) < NEW_TOKENS:
        accepted += [a.num_accepted_drafts for a in driver.speculate(seqs, proposer, k)]
    driver.release(*seqs)
    for s in seqs:
        proposer.release(s.rid)
    allocator = proposer.runner.token_to_kv_pool_allocator
    assert proposer.kv.seqs == {} and allocator.available_size() == allocator.num_pages
    assert target.token_to_kv_pool_allocator.available_size() == target.token_to_kv_pool_allocator.num_pages
    return [s.output_ids[:NEW_TOKENS] for s in seqs], accepted


def test_the_target_as_its_own_draft_has_every_greedy_draft_accepted(target, prompts):
    proposer = DraftModelProposer.load(resolve_model(), resolve_model(), **RUNNER)
    greedy = SamplingParams(temperature=0.0)
    outputs, accepted = speculative(target, proposer, prompts, greedy, k=4)
    assert outputs == plain(target, prompts, greedy)
    assert set(accepted) == {4}


@pytest.fixture(scope="module")
def tiny_draft() -> DraftModelProposer:
    return DraftModelProposer.load(tiny_checkpoint(), resolve_model(), dtype="float32", max_total_tokens=2048)


def test_a_random_draft_changes_no_greedy_output(target, tiny_draft, prompts):
    greedy = SamplingParams(temperature=0.0)
    outputs, accepted = speculative(target, tiny_draft, prompts, greedy, k=3)
    assert outputs == plain(target, prompts, greedy)
    assert sum(accepted) < len(accepted)  # a random model's drafts mostly fall


def test_a_seeded_request_samples_the_same_tokens_again(target, tiny_draft, prompts):
    """The draft samples q under the request's seed, and the rejection rule draws from the seed too."""
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    first, _ = speculative(target, tiny_draft, prompts, params, k=3)
    again, _ = speculative(target, tiny_draft, prompts, params, k=3)
    assert first == again
    other, _ = speculative(
        target, tiny_draft, prompts, SamplingParams(temperature=1.0, top_p=0.95, seed=7), k=3
    )
    assert other != first


def copy_of_tiny(tmp_path: Path) -> Path:
    out = tmp_path / "draft"
    shutil.copytree(tiny_checkpoint(), out)
    return out


def test_a_draft_of_another_vocab_size_is_refused(tmp_path):
    draft = copy_of_tiny(tmp_path)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(config | {"vocab_size": 32000}))
    with pytest.raises(ValueError) as e:
        DraftModelProposer.load(draft, resolve_model(), dtype="float32", max_total_tokens=1024)
    message = str(e.value)
    assert str(draft) in message and str(resolve_model()) in message
    assert "vocab_size 32000 differs from the target's 49152" in message


def test_a_draft_whose_tokenizer_differs_is_refused(tmp_path):
    draft = copy_of_tiny(tmp_path)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="their tokenizers differ") as e:
        DraftModelProposer.load(draft, resolve_model(), dtype="float32", max_total_tokens=1024)
    assert str(draft) in str(e.value) and str(resolve_model()) in str(e.value)
