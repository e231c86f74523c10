"""Multi-LoRA under tensor parallelism: two ranks (gloo, one process each) hold their slices of two
random PEFT adapters (``A`` whole and ``B`` split by output rows on q/k/v/gate/up, ``A`` split by
input columns and ``B`` whole on o/down, the delta joining the partial sum before the all-reduce),
and a batch mixing both adapters with the base model gives HF PEFT's fp32 greedy tokens on every
rank: on tiny random Llama (3 KV heads over 2 ranks: 2 + 1, as SmolLM2's) and Qwen2 (one KV head,
which both ranks replicate) checkpoints. SmolLM2 itself at TP=2, with adapters loaded at run time, is
``tests/tp/test_tp_stacks.py``'s."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.distributed import TpGroup
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.tp_worker import TpModelWorker
from tests.engine.driver import Driver
from tests.engine.test_tensor_parallel import TINY, TINY_FAMILIES, run_ranks
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


def _every_model(tp: TpGroup, cases: dict[str, tuple[Path, dict[str, Path], list[list[int]]]]) -> dict:
    return {name: _mixed_batch(tp, *case) for name, case in cases.items()}


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Tiny random Llama (3 KV heads over 2 ranks: 2 + 1, as SmolLM2's) and Qwen2 (one KV head, which
    both ranks hold, each with two of the four query heads) checkpoints."""
    root = tmp_path_factory.mktemp("tiny")
    for name in ("llama", "qwen2"):
        config, model_class = TINY_FAMILIES[name]
        torch.manual_seed(0)
        model_class(config).save_pretrained(root / name)
    return {name: root / name for name in ("llama", "qwen2")}


def test_tp2_mixed_batch_equals_hf_peft(tiny_checkpoints, tmp_path):
    torch.set_num_threads(1)  # the CI machine is shared
    ids = torch.randint(0, TINY["vocab_size"], (60,), generator=torch.Generator().manual_seed(1)).tolist()
    prompts = [ids[:5], ids[5:60]]
    references, cases = {}, {}
    for name, path in tiny_checkpoints.items():
        references[name], adapters = make_adapters(tmp_path / f"{name}-adapters", base_path=path)
        cases[name] = (path, adapters, prompts)
    ranks = run_ranks(2, _every_model, (cases,), tmp_path)
    assert [r["llama"]["kv_heads"] for r in ranks] == [2, 1]
    assert [r["qwen2"]["kv_heads"] for r in ranks] == [1, 1]  # the one KV head, replicated
    work = [(prompt, name) for prompt in prompts for name in NAMES]
    for case, peft in references.items():
        expected = [peft_greedy(peft, name, prompt, NEW_TOKENS) for prompt, name in work]
        assert ranks[0][case]["tokens"] == ranks[1][case]["tokens"] == expected, case
        for i in range(0, len(work), len(NAMES)):  # not vacuous: each adapter changes the base's tokens
            base, a, b = expected[i : i + len(NAMES)]
            assert base != a and base != b and a != b, case
        assert ranks[0][case]["conserved"] and ranks[1][case]["conserved"], case
