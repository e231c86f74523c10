"""Multi-LoRA through a PD stack (one prefill and one decode worker, KV over NIXL) and the official
``openai`` client: ``--lora-modules`` adapters listed by /v1/models, picked by the request's
``model``, mixed with the base model in flight, applied by both the prefill and the decode worker,
each output equal to HF PEFT's fp32 greedy tokens; an unknown model is a 404 ``model_not_found``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from tests.lora.adapters import make_adapters, peft_greedy
from tests.reference import hf_tokenizer
from tests.stack import SERVED_MODEL, Stack, launch_stack

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    torch.set_num_threads(1)
    model, paths = make_adapters(tmp_path_factory.mktemp("stack-adapters"))
    yield model, paths
    del model


@pytest.fixture(scope="module")
def lora_stack(adapters) -> Stack:
    modules = [f"{name}={path}" for name, path in adapters[1].items()]
    stack = launch_stack(
        "--num-prefill", "1", "--num-decode", "1", "--dtype", "float32", "--max-total-tokens", "4096",
        "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", *modules, log_name="lora",
    )  # fmt: skip
    yield stack
    stack.check_kv_conservation()
    stack.stop()


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0, http_client=httpx.Client(timeout=600)
    )


def test_adapters_are_served_beside_the_base(lora_stack, adapters):
    peft_model, _ = adapters
    api = client(lora_stack)
    assert [m.id for m in api.models.list().data] == [SERVED_MODEL, "pirate", "poet"]
    prompt = hf_tokenizer().encode("The capital of France is") * 4  # whole pages to cache
    # the base model and pirate first (pirate's KV cached), then pirate again (a hit in its own
    # namespace) beside poet (the same tokens: its KV must be computed, not read from the others')
    rounds = [[SERVED_MODEL, "pirate"], ["pirate", "poet"]]

    def complete(model: str) -> str:
        out = api.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
        return out.choices[0].text

    for models in rounds:
        with ThreadPoolExecutor(len(models)) as pool:
            outputs = list(pool.map(complete, models))
        for model, text in zip(models, outputs, strict=True):
            adapter = None if model == SERVED_MODEL else model
            assert text == hf_tokenizer().decode(peft_greedy(peft_model, adapter, prompt, NEW_TOKENS)), model
    with pytest.raises(openai.NotFoundError) as info:
        api.completions.create(model="nobody", prompt="hi", max_tokens=1)
    assert info.value.body["code"] == "model_not_found"
    lora_stack.wait_idle()
