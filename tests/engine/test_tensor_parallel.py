"""Tensor parallelism in the engine: two ranks (gloo, one process each) give TP=1's and HF's greedy
tokens, for SmolLM2 (3 GQA groups split 2 + 1 over 2 ranks) and for tiny random Qwen2 / Qwen3
checkpoints with one KV head replicated on both ranks; rank 0's samples reach every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from pdserve.distributed import TpGroup, destroy_tp_groups, init_tp_group, rendezvous_store
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.tp_worker import TpModelWorker
from pdserve.sampling.sampling_params import SamplingParams
from tests.engine.driver import Driver
from tests.engine.test_greedy_vs_hf import hf_greedy_with_logprobs
from tests.families import hf_greedy

PROMPT_LENS = [1, 33, 180, 450]
NEW_TOKENS = 24
CHUNK = 128  # the longest prompt extends in chunks of this many tokens beside the others' decodes
TINY = dict(
    vocab_size=301,  # odd: the second rank's vocabulary shard ends in a padding row
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=128,
    initializer_range=0.2,  # peaked logits: greedy choices far from ties
    eos_token_id=None,
    tie_word_embeddings=False,
)
TINY_FAMILIES = {
    # one KV head, two ranks: the head is replicated, each rank takes two of its four query heads
    "qwen2": (
        Qwen2Config(**TINY, hidden_size=64, num_attention_heads=4, num_key_value_heads=1),
        Qwen2ForCausalLM,
    ),
    "qwen3": (
        Qwen3Config(**TINY, hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=24),
        Qwen3ForCausalLM,
    ),
    # three GQA groups over two ranks (2 + 1), tied embeddings, biases on q/k/v/o
    "llama": (
        LlamaConfig(
            **{**TINY, "tie_word_embeddings": True},
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=3,
            attention_bias=True,
        ),
        LlamaForCausalLM,
    ),
}


def _rank_main(rank: int, size: int, port: int, target, args: tuple, out_dir: Path) -> None:
    torch.set_num_threads(1)
    tp = init_tp_group(rank, size, f"127.0.0.1:{port}", torch.device("cpu"), timeout_s=120)
    try:
        torch.save(target(tp, *args), out_dir / f"rank{rank}.pt")
    finally:
        destroy_tp_groups()


def run_ranks(size: int, target, args: tuple, out_dir: Path) -> list:
    """``target(tp, *args)`` on ``size`` spawned gloo ranks; every rank's return value, by rank."""
    store = rendezvous_store()
    mp.spawn(_rank_main, args=(size, store.port, target, args, out_dir), nprocs=size, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(size)]


def generate(
    tp: TpGroup, model_path: Path, prompts: list[list[int]], params: list[SamplingParams], chunk: int = CHUNK
) -> dict:
    """``run`` on this rank's shard of the model."""
    runner = ModelRunner(
        model_path, dtype="float32", attention_backend="torch_native", max_total_tokens=4096, tp=tp
    )
    return run(runner, prompts, params, chunk)


def run(
    runner: ModelRunner, prompts: list[list[int]], params: list[SamplingParams], chunk: int = CHUNK
) -> dict:
    """Extend the prompts (the last one in chunks of ``chunk`` tokens, beside the others' first
    decodes), then decode them together; tokens, logprobs and the rank's KV heads and pages."""
    driver = Driver(TpModelWorker(runner))
    seqs = [driver.add(p, sp) for p, sp in zip(prompts, params, strict=True)]
    *short, long = seqs
    driver.step([(s, None) for s in short] + [(long, chunk)])
    while long.num_computed < len(long.prompt):
        driver.step([(s, None) for s in short] + [(long, min(chunk, len(long.prompt) - long.num_computed))])
    while any(len(s.output_ids) < NEW_TOKENS for s in seqs):
        driver.step([(s, None) for s in seqs if len(s.output_ids) < NEW_TOKENS])
    driver.release(*seqs)
    return {
        "tokens": [s.output_ids for s in seqs],
        "logprobs": [s.logprobs for s in seqs],
        "top": [s.top_logprobs for s in seqs],
        "kv_heads": runner.kv_pool.num_kv_heads,
        "pages": runner.token_to_kv_pool_allocator.num_pages,
    }


def greedy(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, return_logprob=True, top_logprobs_num=2) for _ in range(n)]


def test_smollm2_tp2_equals_tp1_and_hf(runner, model_path, hf_model, tokenizer, long_text, tmp_path):
    text_ids = tokenizer(long_text)["input_ids"]
    prompts = [text_ids[11 * i : 11 * i + n] for i, n in enumerate(PROMPT_LENS)]
    ranks = run_ranks(2, generate, (model_path, prompts, greedy(len(prompts))), tmp_path)
    single = run(runner, prompts, greedy(len(prompts)))  # the session's TP=1 engine
    assert [r["kv_heads"] for r in ranks] == [2, 1]  # SmolLM2's 3 KV heads: 2 + 1
    assert ranks[0]["pages"] == ranks[1]["pages"] == 4096 // 16
    for key in ("tokens", "logprobs", "top"):
        assert ranks[1][key] == ranks[0][key], f"rank 1's {key} differ from rank 0's"
    assert ranks[0]["tokens"] == single["tokens"]
    for prompt, tokens, logprobs in zip(prompts, ranks[0]["tokens"], ranks[0]["logprobs"], strict=True):
        ref_tokens, ref_logprobs = hf_greedy_with_logprobs(hf_model, prompt, NEW_TOKENS)
        n = len(ref_tokens)  # HF stops at EOS; the engine only samples
        assert tokens[:n] == ref_tokens, f"prompt of {len(prompt)} tokens diverged from HF"
        assert torch.allclose(torch.tensor(logprobs[:n]), torch.tensor(ref_logprobs), atol=1e-3, rtol=0)


def tiny_families(tp: TpGroup, root: Path, prompts: list[list[int]]) -> dict:
    out = {name: generate(tp, root / name, prompts, greedy(len(prompts)), 32) for name in TINY_FAMILIES}
    sampled = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9, seed=7)]
    out["sampled"] = generate(tp, root / "qwen2", prompts[:2], sampled, 32)["tokens"]
    return out


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    for name, (config, model_class) in TINY_FAMILIES.items():
        torch.manual_seed(0)
        model_class(config).save_pretrained(root / name)
    return root


def test_tiny_checkpoints_with_replicated_kv_heads(tiny_checkpoints, tmp_path):
    ids = torch.randint(0, TINY["vocab_size"], (200,), generator=torch.Generator().manual_seed(1)).tolist()
    prompts = [ids[:3], ids[3:40], ids[40:120]]
    ranks = run_ranks(2, tiny_families, (tiny_checkpoints, prompts), tmp_path)
    assert ranks[0]["qwen2"]["kv_heads"] == ranks[1]["qwen2"]["kv_heads"] == 1
    assert [r["llama"]["kv_heads"] for r in ranks] == [2, 1]
    # unseeded random sampling: rank 0 draws, every rank appends the same tokens
    assert ranks[0]["sampled"] == ranks[1]["sampled"]
    for name, (_, model_class) in TINY_FAMILIES.items():
        single = generate(TpGroup(), tiny_checkpoints / name, prompts, greedy(len(prompts)), 32)
        hf = model_class.from_pretrained(tiny_checkpoints / name, dtype=torch.float32).eval()
        assert ranks[0][name]["tokens"] == ranks[1][name]["tokens"] == single["tokens"], name
        for prompt, tokens in zip(prompts, single["tokens"], strict=True):
            assert tokens == hf_greedy(hf, prompt, NEW_TOKENS), f"{name}: prompt of {len(prompt)} tokens"
