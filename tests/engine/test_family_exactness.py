"""Mistral with a sliding window, Mixtral, Qwen3-MoE, Gemma 3 (tied and untied, with and without
soft-capping) and gpt-oss, from tiny random checkpoints (``tests.families``), through our loader,
model and paged KV: greedy tokens equal HF transformers fp32, with a prompt extended in chunks beside
other requests' decodes, sequences long enough that every window slides several times, on one rank,
on two tensor-parallel ranks (one KV head replicated where the family has one) and, for the MoE
families, on two expert-parallel ranks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model

from pdserve.distributed import TpGroup
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.tp_worker import TpModelWorker
from pdserve.sampling.sampling_params import SamplingParams
from tests.engine.driver import Driver
from tests.engine.test_cpu_decoder import step_logits
from tests.engine.test_tensor_parallel import run_ranks
from tests.families import FAMILIES, WINDOW, hf_greedy, hf_model, make_checkpoint

NEW_TOKENS = 30
CHUNK = 13  # the long prompt extends in chunks of this many tokens beside the others' decodes
MOE = sorted(name for name, family in FAMILIES.items() if family.moe)
# windowed, and with an untied LM head: a tied random Gemma predicts its input token again and again
# (its scaled embedding dominates the residual stream), the same tokens with or without a window
WINDOWED = sorted(n for n, f in FAMILIES.items() if f.windowed and not f.fields.get("tie_word_embeddings"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("families")
    for name in FAMILIES:
        make_checkpoint(name, root / name)
    return root


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    return [ids[:3], ids[3:43], ids[43:153]]  # the last: 110 tokens, ~9 windows of 12


def run(runner: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of ``prompts``: the short ones extend at once, the last in chunks beside their
    decodes, then all decode together."""
    driver = Driver(TpModelWorker(runner))
    seqs = [driver.add(p, SamplingParams(temperature=0.0)) for p in prompts]
    *short, long = seqs
    while long.num_computed < len(long.prompt):
        chunk = min(CHUNK, len(long.prompt) - long.num_computed)
        driver.step([(s, None) for s in short if len(s.output_ids) < NEW_TOKENS] + [(long, chunk)])
    while any(len(s.output_ids) < NEW_TOKENS for s in seqs):
        driver.step([(s, None) for s in seqs if len(s.output_ids) < NEW_TOKENS])
    driver.release(*seqs)
    return [s.output_ids for s in seqs]


def engine(path: Path, tp: TpGroup = TpGroup(), **kwargs) -> ModelRunner:
    return ModelRunner(
        path, dtype="float32", page_size=4, max_total_tokens=2048, max_running_requests=4, tp=tp, **kwargs
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_equals_hf(family, checkpoints, prompts):
    runner = engine(checkpoints / family)
    assert runner.model_config.architecture == FAMILIES[family].model
    hf = hf_model(checkpoints / family)
    assert run(runner, prompts) == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("family", WINDOWED)
def test_the_windows_change_the_tokens(family, checkpoints, prompts):
    """Not a vacuous comparison: with its window as long as the sequence, HF's greedy tokens of the
    long prompt differ from the windowed model's (which ours equal, above)."""
    long = prompts[-1]
    windowed = hf_greedy(hf_model(checkpoints / family), long, NEW_TOKENS)
    full = hf_greedy(hf_model(checkpoints / family, sliding_window=4096), long, NEW_TOKENS)
    assert windowed != full
    assert len(long) + NEW_TOKENS > 10 * WINDOW


def tp_and_ep(tp: TpGroup, root: Path, prompts: list[list[int]]) -> dict:
    out = {name: run(engine(root / name, tp), prompts) for name in FAMILIES}
    out |= {f"{name}+ep": run(engine(root / name, tp, expert_parallel=True), prompts) for name in MOE}
    return out


def test_two_ranks_tensor_and_expert_parallel(checkpoints, prompts, tmp_path):
    """TP=2: heads split (Mistral's, Qwen3-MoE's one KV head replicated), every expert's channels
    split; EP=2: four whole experts a rank. Both ranks agree and give HF's tokens."""
    ranks = run_ranks(2, tp_and_ep, (checkpoints, prompts), tmp_path)
    assert ranks[0] == ranks[1]
    for name, tokens in ranks[0].items():
        hf = hf_model(checkpoints / name.removesuffix("+ep"))
        assert tokens == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts], name


@pytest.mark.parametrize("family", MOE)
def test_stacked_expert_checkpoints_load(family, checkpoints, prompts, tmp_path):
    """Experts stacked as transformers 5 holds them (``experts.gate_up_proj`` [E, 2I, H]; Mixtral's
    ``block_sparse_moe`` as ``mlp``): what a GGUF converts to (``pdserve.model_source``) loads to the
    same tokens as the per-expert checkpoint."""
    hf = hf_model(checkpoints / family)
    (tmp_path / "config.json").write_text((checkpoints / family / "config.json").read_text())
    save_model(hf, str(tmp_path / "model.safetensors"))
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert run(engine(tmp_path), prompts) == expected


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config 'mxfp4'"),
        ({"layer_types": ["chunked_attention"] * 3}, "layer_types ['chunked_attention']"),
    ],
)
def test_unsupported_config_fields_fail_at_load(fields, named, tmp_path):
    config = FAMILIES["gpt_oss"].make_config(300, **fields)
    config.architectures = ["GptOssForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=re.escape(named)):
        engine(tmp_path)


def test_expert_parallel_needs_experts(checkpoints):
    with pytest.raises(ValueError, match="MistralForCausalLM has no mixture-of-experts layers"):
        engine(checkpoints / "mistral", expert_parallel=True)


def test_fused_decoder_slides_its_windows(prompts, tmp_path):
    """A quantized Mistral runs every layer in one C call (``CpuDecoder``), each layer with its window:
    the same logits, bit for bit, as the modules' path, through prefills, chunks and decodes."""
    path = make_checkpoint("mistral", tmp_path, vocab_size=304)  # a multiple of 16: the packed LM head
    runner = ModelRunner(path, dtype="float32", quantization="w4a8", page_size=4, max_total_tokens=2048)
    assert runner.model.model.cpu_decoder is not None
    fused, modules = (step_logits(runner, f, prompts[:2], 30, late=prompts[2]) for f in (True, False))
    assert all(torch.equal(a, b) for a, b in zip(fused, modules, strict=True))
