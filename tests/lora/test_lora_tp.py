"""Multi-LoRA under tensor parallelism: two ranks (gloo, one process each) hold their slices of two
random PEFT adapters (``A`` whole and ``B`` split by output rows on q/k/v/gate/up, ``A`` split by
input columns and ``B`` whole on o/down, the delta joining the partial sum before the all-reduce),
and a batch mixing both adapters with the base model gives HF PEFT's fp32 greedy tokens on every
rank: on SmolLM2 (3 KV heads over 2 ranks: 2 + 1) and on a tiny Qwen2 checkpoint whose one KV head
both ranks replicate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from pdserve.distributed import TpGroup
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.tp_worker import TpModelWorker
from pdserve.model_source import resolve_model
from tests.engine.driver import Driver
from tests.engine.test_tensor_parallel import TINY, run_ranks
from tests.lora.adapters import make_adapters, peft_greedy

NEW_TOKENS = 8
NAMES = (None, "pirate", "poet")  # None: the base model


def _mixed_batch(tp: TpGroup, model_path: Path, adapters: dict[str, Path], prompts: list[list[int]]) -> dict:
    """Every prompt under the base model and each adapter, prefilled and decoded in one batch on this
    rank's shard; the tokens, and whether every page and slot pin came back."""
    runner = ModelRunner(
        model_path,
        dtype="float32",
        attention_backend="torch_native",
        max_total_tokens=1024,
        max_loras=2,
        max_lora_rank=8,
        tp=tp,
    )
    manager = runner.lora_manager
    for name, path in adapters.items():
        manager.add(name, path)
    driver = Driver(TpModelWorker(runner))
    work = [(prompt, name) for prompt in prompts for name in NAMES]
    seqs = [driver.add(p, lora_slot=-1 if n is None else manager.acquire(n)) for p, n in work]
    driver.generate(seqs, NEW_TOKENS)
    driver.release(*seqs)
    for _, name in work:
        if name is not None:
            manager.release(name)
    pages = runner.token_to_kv_pool_allocator
    return {
        "tokens": [s.output_ids for s in seqs],
        "conserved": pages.available_size() == pages.num_pages and not manager.pins,
        "kv_heads": runner.kv_pool.num_kv_heads,
    }


def _both_models(tp: TpGroup, cases: dict[str, tuple[Path, dict[str, Path], list[list[int]]]]) -> dict:
    return {name: _mixed_batch(tp, *case) for name, case in cases.items()}


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> Path:
    """Qwen2 with one KV head: under TP=2 both ranks hold it (each two of the four query heads)."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    config = Qwen2Config(**TINY, hidden_size=64, num_attention_heads=4, num_key_value_heads=1)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def test_tp2_mixed_batch_equals_hf_peft(tiny_qwen2, tmp_path):
    torch.set_num_threads(1)  # the CI machine is shared
    tok = AutoTokenizer.from_pretrained(resolve_model())
    smol_prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):\n    ")]
    ids = torch.randint(0, TINY["vocab_size"], (60,), generator=torch.Generator().manual_seed(1)).tolist()
    tiny_prompts = [ids[:5], ids[5:60]]
    smol_peft, smol_paths = make_adapters(tmp_path / "smol")
    tiny_peft, tiny_paths = make_adapters(tmp_path / "tiny", base_path=tiny_qwen2)
    cases = {
        "smollm2": (resolve_model(), smol_paths, smol_prompts),
        "qwen2": (tiny_qwen2, tiny_paths, tiny_prompts),
    }
    ranks = run_ranks(2, _both_models, (cases,), tmp_path)
    assert [r["smollm2"]["kv_heads"] for r in ranks] == [2, 1]
    assert [r["qwen2"]["kv_heads"] for r in ranks] == [1, 1]  # the one KV head, replicated
    references = {"smollm2": smol_peft, "qwen2": tiny_peft}
    for case, (_, _, prompts) in cases.items():
        work = [(prompt, name) for prompt in prompts for name in NAMES]
        expected = [peft_greedy(references[case], name, prompt, NEW_TOKENS) for prompt, name in work]
        assert ranks[0][case]["tokens"] == ranks[1][case]["tokens"] == expected, case
        for i in range(0, len(work), len(NAMES)):  # not vacuous: each adapter changes the base's tokens
            base, a, b = expected[i : i + len(NAMES)]
            assert base != a and base != b and a != b, case
        assert ranks[0][case]["conserved"] and ranks[1][case]["conserved"], case
