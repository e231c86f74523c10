"""Multi-LoRA in the engine and the scheduler: two random PEFT adapters and the base model in one
batch, every greedy output equal to HF PEFT's fp32 output for its adapter; the adapter checks, the
slots' LRU, a quantized base, and the radix cache keyed on the adapter."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.lora.adapter import LoraAdapterError
from pdserve.lora.manager import LoraInUseError, LoraLimitError, LoraNotFoundError, LoraSlotsFullError
from pdserve.model_source import resolve_model
from pdserve.scheduler.table import UnknownAdapter
from tests.engine.driver import Driver
from tests.lora.adapters import make_adapters, peft_greedy
from tests.scheduler.driver import drive, fresh, req

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    torch.set_num_threads(1)  # the CI machine is shared
    model, paths = make_adapters(tmp_path_factory.mktemp("adapters"))
    yield model, paths
    del model


@pytest.fixture(scope="module")
def runner(adapters) -> ModelRunner:
    runner = ModelRunner(
        resolve_model(),
        dtype="float32",
        max_total_tokens=2048,
        max_running_requests=8,
        max_loras=2,
        max_lora_rank=8,
        max_loaded_loras=3,
    )
    for name, path in adapters[1].items():
        runner.lora_manager.add(name, path)
    yield runner
    del runner


def test_mixed_batch_equals_hf_peft(runner, adapters, tokenizer_prompts):
    """Base, adapter pirate and adapter poet, two prompts each, prefilled and decoded in one batch."""
    peft_model, _ = adapters
    manager = runner.lora_manager
    driver = Driver(runner)
    work = [(prompt, name) for prompt in tokenizer_prompts for name in (None, "pirate", "poet")]
    seqs = [driver.add(p, lora_slot=-1 if n is None else manager.acquire(n)) for p, n in work]
    try:
        driver.generate(seqs, NEW_TOKENS)
    finally:
        driver.release(*seqs)
        for _, name in work:
            if name is not None:
                manager.release(name)
    expected = [peft_greedy(peft_model, name, prompt, NEW_TOKENS) for prompt, name in work]
    assert [s.output_ids for s in seqs] == expected
    for i in range(0, len(work), 3):  # not vacuous: each adapter changes the base's tokens
        base, a, b = expected[i : i + 3]
        assert base != a and base != b and a != b
    pages = runner.token_to_kv_pool_allocator
    assert pages.available_size() == pages.num_pages
    assert not manager.pins


@pytest.fixture(scope="module")
def tokenizer_prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model())
    return [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):\n    ")]


def test_slots_are_lru_over_unpinned_adapters(runner, adapters, tmp_path):
    """LRU over the unpinned slots; and at most ``max_loaded_loras`` (3) adapters loaded: a fourth is
    refused before any read (a path that does not exist is not even looked at), nothing added."""
    manager = runner.lora_manager
    manager.add("c", adapters[1]["pirate"])
    with pytest.raises(LoraLimitError, match="--max-loaded-loras 3"):
        manager.add("d", tmp_path / "missing")
    assert sorted(manager.adapters) == ["c", "pirate", "poet"]
    manager.add("c", adapters[1]["poet"])  # replacing one is no new adapter
    manager.add("c", adapters[1]["pirate"])
    try:
        slot_a, slot_b = manager.acquire("pirate"), manager.acquire("poet")
        with pytest.raises(LoraSlotsFullError):
            manager.acquire("c")  # both slots pinned by running requests
        with pytest.raises(LoraInUseError):
            manager.remove("pirate")
        manager.release("pirate")
        assert manager.acquire("c") == slot_a  # pirate was the unpinned one: evicted
        assert manager.resident == {"poet": slot_b, "c": slot_a}
        manager.release("poet")
        manager.release("c")
    finally:
        manager.remove("c")
    with pytest.raises(LoraNotFoundError):
        manager.acquire("c")


def test_adapters_that_do_not_fit_are_refused(runner, adapters, tmp_path):
    manager = runner.lora_manager
    with pytest.raises(LoraAdapterError, match="adapter_config.json"):
        manager.add("x", tmp_path / "missing")
    too_big = tmp_path / "rank"
    too_big.mkdir()
    for file in adapters[1]["pirate"].iterdir():
        (too_big / file.name).write_bytes(file.read_bytes())
    config = json.loads((too_big / "adapter_config.json").read_text())
    (too_big / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    with pytest.raises(LoraAdapterError, match="rank 64"):
        manager.add("x", too_big)

    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    tiny = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(resolve_model(), num_hidden_layers=1, vocab_size=64)
    )
    head = get_peft_model(tiny, LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    head.save_pretrained(tmp_path / "head")
    with pytest.raises(LoraAdapterError, match="lm_head"):
        manager.add("x", tmp_path / "head")
    assert "x" not in manager.adapters


def test_quantized_base_takes_the_adapters(adapters, tokenizer_prompts):
    """On a w4a8 base (``make run``'s CPU default), where base-only steps run the fused C decoder: a
    batch with adapter tokens runs the modules (the delta on top of the quantized matmuls), its base
    rows equal the base-only batch's tokens, and its adapter rows their adapter-only batch's."""
    runner = ModelRunner(
        resolve_model(),
        dtype="float32",
        quantization="w4a8",
        max_total_tokens=1024,
        max_loras=1,
        max_lora_rank=8,
    )
    assert runner.model.model.cpu_decoder is not None
    runner.lora_manager.add("pirate", adapters[1]["pirate"])
    slot = runner.lora_manager.acquire("pirate")
    prompt = tokenizer_prompts[0]

    def greedy(slots: list[int]) -> list[list[int]]:
        driver = Driver(runner)
        seqs = [driver.add(prompt, lora_slot=s) for s in slots]
        driver.generate(seqs, NEW_TOKENS)
        driver.release(*seqs)
        return [s.output_ids for s in seqs]

    base, adapted = greedy([-1])[0], greedy([slot])[0]
    assert greedy([-1, slot]) == [base, adapted]
    assert base != adapted


def test_scheduler_keeps_adapters_kv_apart(runner, adapters, tokenizer_prompts):
    """Through the scheduler: the same prompt under the base model and each adapter gives HF PEFT's
    tokens; a radix-cache hit is found under the same adapter only (never across adapters); an
    unknown adapter is refused at ``add_request``; no slot stays pinned and no page leaks."""
    peft_model, _ = adapters
    prompt = tokenizer_prompts[0] * 4  # 2+ pages of 16 tokens
    sched = fresh(runner)
    first = [req(f"first-{n}", prompt, NEW_TOKENS, lora_name=n) for n in ("", "pirate")]
    second = [req(f"second-{n}", prompt, NEW_TOKENS, lora_name=n) for n in ("pirate", "poet", "")]
    for r in first:
        sched.add_request(r)
    done = drive(sched)
    for r in second:
        sched.add_request(r)
    done |= drive(sched)
    for r in first + second:
        name = r.sampling_params.lora_name or None
        assert done[r.rid].output_ids == peft_greedy(peft_model, name, prompt, NEW_TOKENS), r.rid
    hits = {r.rid: r.cached_tokens for r in second}
    assert hits["second-pirate"] > 0 and hits["second-"] > 0  # its own adapter's (the base's) prefix
    assert hits["second-poet"] == 0  # the base's and pirate's pages hold other KV
    with pytest.raises(UnknownAdapter, match="The model 'nobody' does not exist"):
        sched.add_request(req("unknown", prompt, NEW_TOKENS, lora_name="nobody"))
    assert not runner.lora_manager.pins
