"""/v1/embeddings through the served stack, colocated and PD (the stacks of ``conftest.py``: float32,
32-token prefill chunks), read by the official ``openai`` client: last-token pooling (the default
model has no sentence-transformers config) equals HF transformers' normalised ``last_hidden_state``
within 1e-5; an input's vector is the same alone and in a batch of several inputs, within SAME =
1e-6 (these stacks run float32, whose matmuls are MKL's and not batch-invariant: on an AMD Zen 4
a row of ``F.linear`` alone and among others differs by ~2e-5 in a 576-wide projection, and the
vector in the 7th-8th digit; bit-identical on a Sapphire Rapids-class Xeon, docs/cpu.md); base64 is
the same float32 values; ``dimensions`` truncates and re-normalises; the public gRPC API's Embed
(through the SDK) returns the same vectors; bad input is an OpenAI-shaped 400. Every scheduler's KV
pool is conserved after each test."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
import torch
from pdserve_sdk import Client, InvalidRequestError

from pdserve.sampling.bounds import MAX_EMBEDDING_INPUTS
from tests.reference import context_length, hf_embedding, hf_tokenizer
from tests.scoring.conftest import client, computed_prompt_tokens
from tests.stack import SERVED_MODEL

TOL = 1e-5
SAME = 1e-6  # one input's vector computed in different batches (see the module docstring)


def same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and float(np.abs(np.asarray(a) - np.asarray(b)).max()) < SAME


LONG = (
    "Question: What is the capital of France? Answer: Paris is the capital and the largest city of "
    "France, on the river Seine, and it has been a centre of finance, diplomacy and the arts."
)
SHORT = "The quick brown fox jumps over the lazy dog."


def embed(stack, inputs, **kwargs):
    return client(stack).embeddings.create(model=SERVED_MODEL, input=inputs, **kwargs)


def test_embeddings_equal_hf_and_do_not_depend_on_the_batch(stack):
    long_ids = hf_tokenizer()(LONG)["input_ids"]
    assert len(long_ids) > 32  # more than one chunk
    short_ids = hf_tokenizer()(SHORT)["input_ids"]
    alone = embed(stack, long_ids, encoding_format="float")
    assert alone.object == "list" and alone.model == SERVED_MODEL
    assert alone.usage.prompt_tokens == alone.usage.total_tokens == len(long_ids)
    vector = torch.tensor(alone.data[0].embedding)
    assert vector.shape == (576,)
    assert (vector - hf_embedding(long_ids)).abs().max().item() < TOL

    batch = embed(stack, [short_ids, long_ids, [7, 8, 9]], encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1, 2]
    assert batch.usage.prompt_tokens == len(short_ids) + len(long_ids) + 3
    assert same(batch.data[1].embedding, alone.data[0].embedding)
    for d, ids in zip(batch.data, [short_ids, long_ids, [7, 8, 9]], strict=True):
        assert (torch.tensor(d.embedding) - hf_embedding(ids)).abs().max().item() < TOL


def test_identical_inputs_are_computed_once(stack):
    long_ids = hf_tokenizer()(LONG)["input_ids"]
    before = computed_prompt_tokens(stack)
    out = embed(stack, [long_ids, [7, 8, 9], long_ids, long_ids, [7, 8, 9]], encoding_format="float")
    assert computed_prompt_tokens(stack) - before == len(long_ids) + 3  # (embeddings use no cache)
    assert out.usage.prompt_tokens == 3 * len(long_ids) + 2 * 3  # every input counts, as sent
    assert [d.index for d in out.data] == [0, 1, 2, 3, 4]
    alone = embed(stack, long_ids, encoding_format="float").data[0].embedding
    assert out.data[0].embedding == out.data[2].embedding == out.data[3].embedding  # one computation
    assert same(out.data[0].embedding, alone)  # computed in another batch
    assert out.data[1].embedding == out.data[4].embedding
    assert (torch.tensor(out.data[1].embedding) - hf_embedding([7, 8, 9])).abs().max().item() < TOL


def test_strings_base64_and_dimensions(stack):
    ids = hf_tokenizer()(SHORT)["input_ids"]
    floats = embed(stack, [SHORT], encoding_format="float").data[0].embedding
    assert floats == embed(stack, ids, encoding_format="float").data[0].embedding  # the same tokens
    raw = httpx.post(
        f"{stack.base_url}/v1/embeddings",
        json={"model": SERVED_MODEL, "input": SHORT, "encoding_format": "base64"},
        timeout=60,
    ).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == floats
    assert embed(stack, SHORT).data[0].embedding == floats  # the client's default: base64, decoded
    cut = embed(stack, SHORT, dimensions=64, encoding_format="float").data[0].embedding
    expected = torch.nn.functional.normalize(torch.tensor(floats[:64]), dim=0)
    assert len(cut) == 64 and (torch.tensor(cut) - expected).abs().max().item() < 1e-6


def test_the_grpc_api_embeds_as_http(stack):
    ids = hf_tokenizer()(SHORT)["input_ids"]
    http = embed(stack, [SHORT, LONG], encoding_format="float")
    with Client(stack.grpc_address) as sdk:
        out = sdk.embed([SHORT, LONG])
        assert all(same(list(v), d.embedding) for v, d in zip(out.embeddings, http.data, strict=True))
        assert out.prompt_tokens == http.usage.prompt_tokens
        cut = sdk.embed([ids], dimensions=64).embeddings[0]
        assert same(list(cut), embed(stack, ids, dimensions=64, encoding_format="float").data[0].embedding)
        with pytest.raises(InvalidRequestError):
            sdk.embed([], timeout=60)


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": ""}, "input", None),
        ({"input": []}, "input", None),
        ({"input": ["a", ""]}, "input", None),
        ({"input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)}, "input", None),
        # more distinct inputs than the decode worker queues (128) can never be served: not a 429
        ({"input": [[t] for t in range(1, 151)]}, "input", None),
        ({"input": [-1]}, "input.0", None),
        ({"input": [1] * 9000}, "input", "context_length_exceeded"),
        ({"input": "Hi", "dimensions": 0}, "dimensions", None),
        ({"input": "Hi", "dimensions": 577}, "dimensions", None),
        ({"input": "Hi", "encoding_format": "int8"}, "encoding_format", None),
    ],
)
def test_bad_embedding_requests_are_400s(stack, body, param, code):
    assert context_length() < 9000
    r = httpx.post(f"{stack.base_url}/v1/embeddings", json={"model": SERVED_MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, json.dumps(error)
    if code is not None:
        assert error["code"] == code
