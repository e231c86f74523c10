"""Multi-LoRA through a PD stack (one prefill and one decode worker, KV over NIXL) and the official
``openai`` client: ``--lora-modules`` adapters listed by /v1/models, picked by the request's
``model``, mixed with the base model in flight, applied by both the prefill and the decode worker,
each output equal to HF PEFT's fp32 greedy tokens and each response naming the adapter as its
``model`` (completions, chat, responses, a stream's chunks); an unknown model is a 404
``model_not_found``.
A third adapter loaded at run time (``/v1/load_lora_adapter``) is served the same way until it is
unloaded (``/v1/unload_lora_adapter``), and each refusal has its status; the public gRPC API's
``LoadLoraAdapter`` / ``UnloadLoraAdapter`` (through the SDK) do the same. A fourth adapter is over
``--max-loaded-loras 3``: 429 (RESOURCE_EXHAUSTED on gRPC), nothing loaded anywhere. A request whose
adapter a worker unloaded while it travelled gets 404 ``model_not_found``, as an unknown model."""

from __future__ import annotations

import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
import torch
from pdserve_sdk import Client, InvalidRequestError, NotFoundError, PdServeError, RateLimitError
from safetensors.torch import load_file, save_file

from pdserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.lora.adapters import ADAPTERS, make_adapters, peft_greedy
from tests.reference import hf_tokenizer
from tests.stack import SERVED_MODEL, Stack, launch_stack

NEW_TOKENS = 8
# loaded at run time, not at start: rank 2 on four projections none of the others pairs alike
LATE = {"sailor": (2, 4, ["k_proj", "o_proj", "gate_proj", "up_proj"], False)}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    torch.set_num_threads(1)
    model, paths = make_adapters(tmp_path_factory.mktemp("stack-adapters"), {**ADAPTERS, **LATE})
    yield model, paths
    del model


@pytest.fixture(scope="module")
def lora_stack(adapters) -> Stack:
    modules = [f"{name}={path}" for name, path in adapters[1].items() if name not in LATE]
    stack = launch_stack(
        "--num-prefill", "1", "--num-decode", "1", "--dtype", "float32", "--max-total-tokens", "4096",
        "--max-loras", "2", "--max-loaded-loras", "3", "--max-lora-rank", "8", "--lora-modules", *modules,
        log_name="lora",
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
        assert out.model == model
        return out.choices[0].text

    for models in rounds:
        with ThreadPoolExecutor(len(models)) as pool:
            outputs = list(pool.map(complete, models))
        for model, text in zip(models, outputs, strict=True):
            adapter = None if model == SERVED_MODEL else model
            assert text == hf_tokenizer().decode(peft_greedy(peft_model, adapter, prompt, NEW_TOKENS)), model
    messages = [{"role": "user", "content": "Ahoy"}]
    assert api.chat.completions.create(model="poet", messages=messages, max_tokens=2).model == "poet"
    assert api.responses.create(model="pirate", input="Ahoy", max_output_tokens=2).model == "pirate"
    with pytest.raises(openai.NotFoundError) as info:
        api.completions.create(model="nobody", prompt="hi", max_tokens=1)
    assert info.value.body["code"] == "model_not_found"
    lora_stack.wait_idle()


def test_adapter_loaded_and_unloaded_at_run_time(lora_stack, adapters, tmp_path):
    peft_model, paths = adapters
    api, http = client(lora_stack), httpx.Client(base_url=lora_stack.base_url, timeout=600)
    load = lambda **body: http.post("/v1/load_lora_adapter", json=body)
    unload = lambda name: http.post("/v1/unload_lora_adapter", json={"lora_name": name})
    # refusals, each of one request, before anything changed
    bad_rank, lm_head = tmp_path / "rank16", tmp_path / "lm_head"
    for bad in (bad_rank, lm_head):
        shutil.copytree(paths["sailor"], bad)
    config = json.loads((bad_rank / "adapter_config.json").read_text())
    (bad_rank / "adapter_config.json").write_text(json.dumps({**config, "r": 16}))  # --max-lora-rank 8
    weights = load_file(lm_head / "adapter_model.safetensors")
    weights["base_model.model.lm_head.lora_A.weight"] = torch.zeros(2, 576)
    save_file(weights, lm_head / "adapter_model.safetensors")
    for body, status, words in [
        ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, 400, "no readable"),
        ({"lora_name": "x", "lora_path": str(bad_rank)}, 400, "rank 16"),
        ({"lora_name": "x", "lora_path": str(lm_head)}, 400, "does not have"),
        ({"lora_name": "x" * 129, "lora_path": str(paths["sailor"])}, 400, "lora_name"),
        ({"lora_name": "pirate", "lora_path": str(paths["sailor"])}, 409, "already served"),
        ({"lora_name": SERVED_MODEL, "lora_path": str(paths["sailor"])}, 409, "already served"),
    ]:
        r = load(**body)
        assert (r.status_code, r.json()["error"]["type"] != "") == (status, True), r.text
        assert words in r.json()["error"]["message"], r.text
    r = unload("sailor")
    assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found"), r.text

    r = load(lora_name="sailor", lora_path=str(paths["sailor"]))
    assert r.status_code == 200, r.text
    assert [m.id for m in api.models.list().data] == [SERVED_MODEL, "pirate", "poet", "sailor"]
    prompt = hf_tokenizer().encode("The capital of France is")
    out = api.completions.create(model="sailor", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
    assert out.choices[0].text == hf_tokenizer().decode(peft_greedy(peft_model, "sailor", prompt, NEW_TOKENS))
    assert load(lora_name="sailor", lora_path=str(paths["sailor"])).status_code == 409

    # in use by a running request: 409 naming the worker, and the adapter still served
    stream = api.completions.create(
        model="sailor",
        prompt=prompt,
        max_tokens=48,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert next(iter(stream)).model == "sailor"
    r = unload("sailor")
    assert r.status_code == 409 and "decode-scheduler" in r.json()["error"]["message"], r.text
    assert len("".join(chunk.choices[0].text for chunk in stream)) > 0
    lora_stack.wait_idle()

    r = unload("sailor")
    assert r.status_code == 200, r.text
    assert [m.id for m in api.models.list().data] == [SERVED_MODEL, "pirate", "poet"]
    with pytest.raises(openai.NotFoundError) as info:
        api.completions.create(model="sailor", prompt=prompt, max_tokens=1)
    assert info.value.body["code"] == "model_not_found"

    # the same calls on the public gRPC API, through the SDK
    with Client(lora_stack.grpc_address, timeout=600) as sdk:
        assert "sailor" in sdk.load_lora_adapter("sailor", str(paths["sailor"]))
        with pytest.raises(PdServeError) as refused:
            sdk.load_lora_adapter("sailor", str(paths["sailor"]))
        assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(InvalidRequestError, match="lora_name"):
            sdk.load_lora_adapter("", str(paths["sailor"]))
        assert [m.id for m in api.models.list().data] == [SERVED_MODEL, "pirate", "poet", "sailor"]
        assert "sailor" in sdk.unload_lora_adapter("sailor")
        with pytest.raises(NotFoundError):
            sdk.unload_lora_adapter("sailor")
    lora_stack.wait_idle()


def test_loading_needs_lora_enabled(colocated):
    """A server started without --enable-lora / --lora-modules: the worker refuses (400 naming the
    flag) and nothing is served under the name (the session's colocated stack, one request)."""
    r = httpx.post(
        f"{colocated.base_url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"}, timeout=60
    )
    assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"], r.text
    assert "a" not in [
        m["id"] for m in httpx.get(f"{colocated.base_url}/v1/models", timeout=60).json()["data"]
    ]


def test_a_cancelled_grpc_load_or_unload_still_changes_every_worker(lora_stack, adapters):
    """A LoadLoraAdapter / UnloadLoraAdapter whose gRPC deadline passes mid-broadcast runs to its
    end on the gateway: no worker is left holding the adapter under a name the gateway does not
    serve (which made the name impossible to load again, ALREADY_EXISTS from that worker)."""
    path = str(adapters[1]["sailor"])
    http = httpx.Client(base_url=lora_stack.base_url, timeout=600)
    with Client(lora_stack.grpc_address) as sdk:
        for deadline in (0.005, 0.02, 0.05):
            with pytest.raises(PdServeError):  # DEADLINE_EXCEEDED, or 409 where the load ran first
                sdk.load_lora_adapter("sailor", path, timeout=deadline)
                sdk.load_lora_adapter("sailor", path, timeout=deadline)
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "sailor", "lora_path": path})
            assert r.status_code == 200 or "is already served" in r.json()["error"]["message"], r.text
            with pytest.raises(PdServeError):
                sdk.unload_lora_adapter("sailor", timeout=deadline)
                sdk.unload_lora_adapter("sailor", timeout=deadline)
            r = http.post("/v1/unload_lora_adapter", json={"lora_name": "sailor"})
            assert r.status_code == 200 or r.json()["error"]["code"] == "model_not_found", r.text
            # every worker is back without it: a load and an unload both pass on all of them
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "sailor", "lora_path": path})
            assert r.status_code == 200, r.text
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "sailor"}).status_code == 200
    lora_stack.wait_idle()


def listed(stack: Stack, sdk: Client) -> list[tuple[str, str | None]]:
    """``(id, parent)`` of /v1/models, after checking that the gRPC API's ListModels (the SDK's
    ``models``) lists the same."""
    data = httpx.get(f"{stack.base_url}/v1/models", timeout=60).json()["data"]
    http = [(m["id"], m["parent"]) for m in data]
    assert [(m.id, m.parent or None) for m in sdk.models()] == http
    return http


def worker_call(address: str, role: str, method: str, **fields: str) -> None:
    """A scheduler worker's own ``LoadLoraAdapter`` / ``UnloadLoraAdapter`` (the internal calls the
    gateway broadcasts), to put one worker in the state a broadcast passes through."""
    stub = {
        "decode": scheduler_pb2_grpc.DecodeSchedulerStub,
        "prefill": scheduler_pb2_grpc.PrefillSchedulerStub,
    }
    request = getattr(scheduler_pb2, f"{method}Request")(**fields)
    with grpc.insecure_channel(address) as channel:
        getattr(stub[role](channel), method)(request, timeout=120)


def test_too_many_adapters_is_a_429_and_nothing_is_loaded(lora_stack, adapters):
    """pirate, poet and sailor loaded: a fourth is over --max-loaded-loras 3, refused by the first
    worker asked (429 over HTTP, RESOURCE_EXHAUSTED through the SDK) with nothing loaded anywhere:
    once sailor is unloaded, the fourth loads on every worker (a worker still holding it would
    refuse with 409). ListModels lists what /v1/models does, adapters with their base model."""
    path = str(adapters[1]["sailor"])
    http = httpx.Client(base_url=lora_stack.base_url, timeout=600)
    load = lambda name: http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
    unload = lambda name: http.post("/v1/unload_lora_adapter", json={"lora_name": name})
    adapter = lambda name: (name, SERVED_MODEL)
    with Client(lora_stack.grpc_address, timeout=600) as sdk:
        assert load("sailor").status_code == 200
        three = [(SERVED_MODEL, None), adapter("pirate"), adapter("poet"), adapter("sailor")]
        assert listed(lora_stack, sdk) == three
        r = load("extra")
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "too_many_requests"), r.text
        assert "--max-loaded-loras 3" in error["message"] and "unload one first" in error["message"]
        with pytest.raises(RateLimitError, match="--max-loaded-loras 3") as refused:
            sdk.load_lora_adapter("extra", path)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert listed(lora_stack, sdk) == three
        assert unload("sailor").status_code == 200
        assert load("extra").status_code == 200, "a worker kept the refused adapter"
        assert listed(lora_stack, sdk) == three[:3] + [adapter("extra")]
        assert sdk.unload_lora_adapter("extra")
        assert listed(lora_stack, sdk) == three[:3]
    lora_stack.wait_idle()


def test_a_request_racing_an_unload_is_a_404(lora_stack, adapters):
    """An unload's broadcast reaches the decode worker before the gateway stops serving the name: a
    request the gateway let through then finds no adapter at the worker, and is a 404
    ``model_not_found`` (not a 400), over HTTP (plain and streamed) and gRPC. Then three clients
    send the adapter's requests one after another while it is unloaded through the gateway (the
    unload tried again while a worker holds one of them, 409): each completes or is a 404, and the
    server goes on serving."""
    path = str(adapters[1]["sailor"])
    http = httpx.Client(base_url=lora_stack.base_url, timeout=600)
    api = client(lora_stack)
    assert (
        http.post("/v1/load_lora_adapter", json={"lora_name": "sailor", "lora_path": path}).status_code == 200
    )
    decode = list(http.get("/health").json()["roles"]["decode"])[0]
    worker_call(decode, "decode", "UnloadLoraAdapter", lora_name="sailor")  # the broadcast's first step
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as info:
            api.completions.create(model="sailor", prompt="Ahoy", max_tokens=2, stream=stream)
        assert info.value.body["code"] == "model_not_found", info.value.body
        assert info.value.body["message"] == "The model 'sailor' does not exist.", info.value.body
    with (
        Client(lora_stack.grpc_address, timeout=600) as sdk,
        pytest.raises(NotFoundError, match="does not exist"),
    ):
        sdk.generate("Ahoy", model="sailor", max_new_tokens=2)
    worker_call(decode, "decode", "LoadLoraAdapter", lora_name="sailor", lora_path=path)

    def complete() -> int:
        try:
            api.completions.create(model="sailor", prompt="Ahoy", max_tokens=2, temperature=0)
        except openai.NotFoundError as e:
            assert e.body["code"] == "model_not_found", e.body
            return 404
        served.set()
        return 200

    def client_loop(_: int) -> list[int]:
        """Requests one after another until one is a 404 (the unload went through), three at most."""
        outcomes = [complete()]
        while outcomes[-1] == 200 and len(outcomes) < 3:
            outcomes.append(complete())
        return outcomes

    served = threading.Event()
    with ThreadPoolExecutor(3) as pool:
        outcomes = pool.map(client_loop, range(3))
        assert served.wait(300)  # the unload starts among the adapter's requests
        while (r := http.post("/v1/unload_lora_adapter", json={"lora_name": "sailor"})).status_code == 409:
            time.sleep(0.05)  # in use by a request held on a worker: tried again
        assert r.status_code == 200, r.text
        assert all(set(each) <= {200, 404} for each in outcomes)
    assert api.completions.create(model=SERVED_MODEL, prompt="Ahoy", max_tokens=2).choices[0].text
    lora_stack.wait_idle()


def test_adapter_names_are_bounded_at_the_gateway_and_the_workers(lora_stack, adapters):
    """A name with whitespace, a control character or over 128 characters is refused at load with a
    400 naming lora_name (INVALID_ARGUMENT through the SDK), and by each worker's own call too."""
    path = str(adapters[1]["sailor"])
    http = httpx.Client(base_url=lora_stack.base_url, timeout=600)
    bad = ["a b", "tab\there", "bell\x07", "nul\x00", "line\u2028sep", "x" * 129]
    with Client(lora_stack.grpc_address, timeout=600) as sdk:
        for name in bad:
            r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
            assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_name"), (name, r.text)
            with pytest.raises(InvalidRequestError, match="lora_name"):
                sdk.load_lora_adapter(name, path)
        for role, address in [(role, a) for role, ws in lora_stack_roles(http).items() for a in ws]:
            with pytest.raises(grpc.RpcError) as refused:
                worker_call(address, role, "LoadLoraAdapter", lora_name="a b", lora_path=path)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, role
            assert "whitespace" in refused.value.details()
        assert [m.id for m in sdk.models()] == [SERVED_MODEL, "pirate", "poet"]


def lora_stack_roles(http: httpx.Client) -> dict[str, list[str]]:
    """role -> the addresses of its scheduler workers, from /health."""
    roles = http.get("/health").json()["roles"]
    return {role: list(roles[role]) for role in ("prefill", "decode")}
