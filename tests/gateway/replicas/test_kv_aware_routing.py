"""kv_aware routing (issue 40, part 2) over two colocated decode workers and two gateway replicas.

Two ``pdserve gateway --router-policy kv_aware`` replicas follow the KV events of both decode workers
of ``two_decode_stack``. A long prefix is planted on one worker through the launcher's round_robin
gateway; both replicas then send every prompt that shares it to that worker, and their indexes agree
block for block. After that worker's cache is flushed and the prefix planted on the other one, the
routing follows (a router that guessed from its own traffic would still pick the first). Which worker
served a request comes from the schedulers' prompt-token counters (requests go one at a time).

A LoRA adapter's prefix, cached under the adapter's own radix namespace, draws its prompts to the
worker that cached it too, while both workers report the adapter in their LoRA slots (``GetLoad``).

A gateway that cannot trust a worker's index (its stream down, or lagging behind the requests sent
there) routes it by load alone and logs that once: shown in process, over real subscriptions.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from pdserve.mem_cache.block_hash import block_hashes
from pdserve.services.gateway.routing.kv_subscriptions import KVIndexes
from pdserve.services.gateway.routing.policies import KVAwarePolicy, KVAwareWeights
from pdserve.services.gateway.routing.workers import WorkerPool
from pdserve.services.gateway.transport.backend_clients import BackendClients
from pdserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.gateway.replicas.conftest import PAGE_SIZE, start_gateway
from tests.lora.adapters import ADAPTERS, make_adapters
from tests.reference import hf_tokenizer
from tests.stack import Stack, free_port_block

PROMPT_TOKENS = "pdserve:prompt_tokens_total"
INDEX_BLOCKS = "pdserve:router_kv_index_blocks"


ADAPTER = "pirate"


@pytest.fixture(scope="module")
def adapter_path(tmp_path_factory) -> Path:
    """A random PEFT adapter of SmolLM2 (the workers load it at run time, in the test that uses it)."""
    torch.set_num_threads(1)  # the CI machine is shared: one thread avoids OpenMP spin-waits
    model, paths = make_adapters(tmp_path_factory.mktemp("router-adapter"), {ADAPTER: ADAPTERS[ADAPTER]})
    del model
    return paths[ADAPTER]


@pytest.fixture(scope="module")
def kv_replicas(two_decode_stack: Stack, adapter_path: Path) -> list[Stack]:
    """Two kv_aware gateway replicas over ``two_decode_stack``'s workers, serving ``ADAPTER``'s name
    (stopped after the module)."""
    replicas: list[Stack] = []
    flags = ("--router-policy", "kv_aware", "--lora-modules", f"{ADAPTER}={adapter_path}")
    try:
        for i in range(2):
            name = f"gateway-kv-aware-{i}"
            replicas.append(start_gateway(two_decode_stack, *flags, log_name=name, timeout=180))
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()


def decode_addresses(stack: Stack) -> list[str]:
    return list(httpx.get(f"{stack.base_url}/health", timeout=10).json()["roles"]["decode"])


def flush(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.DecodeSchedulerStub(channel)
        assert stub.FlushCache(scheduler_pb2.FlushCacheRequest(), timeout=30).flushed


def served_by(gateway: Stack, backend: Stack, input_ids: list[int], model: str | None = None) -> str:
    """Send ``input_ids`` through ``gateway`` (greedy, 2 tokens; under LoRA adapter ``model`` when
    given); the decode worker that served it."""
    before = backend.scheduler_values(PROMPT_TOKENS)
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
    r = httpx.post(f"{gateway.base_url}/generate", json={**body, "model": model}, timeout=300)
    assert r.status_code == 200, r.text
    moved = {k[1]: v - before.get(k, 0.0) for k, v in backend.scheduler_values(PROMPT_TOKENS).items()}
    (worker,) = [w for w, d in moved.items() if d]
    assert moved[worker] == len(input_ids)
    return worker


def resident(address: str) -> list[str]:
    """The LoRA adapters in the worker's slots, as its ``GetLoad`` reports them."""
    with grpc.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.DecodeSchedulerStub(channel)
        return list(stub.GetLoad(scheduler_pb2.LoadRequest(), timeout=30).lora_resident)


def index_blocks(replica: Stack) -> dict[str, float]:
    """backend worker -> blocks in the replica's index of it."""
    return {k[0]: v for k, v in replica.metrics(by=("backend",)).get(INDEX_BLOCKS, {}).items()}


def wait_for_indexes(replicas: list[Stack], check, timeout: float = 30.0) -> dict[str, float]:
    """Poll every replica's index gauges until ``check(blocks)`` holds for each; returns the first's."""
    deadline = time.monotonic() + timeout
    while True:
        seen = [index_blocks(r) for r in replicas]
        if all(check(blocks) for blocks in seen):
            return seen[0]
        assert time.monotonic() < deadline, seen
        time.sleep(0.2)


def plant(backend: Stack, target: str, input_ids: list[int]) -> None:
    """Cache ``input_ids`` on ``target`` only, through the round_robin gateway (flushing the other
    worker when a turn lands there)."""
    for _ in range(2):
        worker = served_by(backend, backend, input_ids)
        if worker == target:
            return
        backend.wait_idle()
        flush(worker)
    raise AssertionError(f"round_robin never reached {target}")


def test_replicas_route_a_shared_prefix_to_the_worker_its_events_name(
    two_decode: Stack, kv_replicas: list[Stack]
) -> None:
    addresses = decode_addresses(two_decode)
    two_decode.wait_idle()
    for address in addresses:
        flush(address)
    wait_for_indexes(kv_replicas, lambda blocks: set(blocks) == set(addresses) and not any(blocks.values()))
    tok = hf_tokenizer()
    system = " ".join(f"Clause {i}: the tenant's system prompt stays cached." for i in range(30))
    prefix = tok(system)["input_ids"]
    prompts = [prefix + tok(f" Question {i}: what does clause {i} say?")["input_ids"] for i in range(4)]
    prefix_blocks = len(block_hashes(prefix, PAGE_SIZE))
    assert prefix_blocks >= 20

    for holder, other in (addresses, addresses[::-1]):
        plant(two_decode, holder, prompts[0])
        wait_for_indexes(kv_replicas, lambda b, h=holder, o=other: b[h] >= prefix_blocks and b[o] == 0)
        # every replica sends every prompt of the prefix to its holder
        for i, input_ids in enumerate(prompts[1:] * 2):
            assert served_by(kv_replicas[i % 2], two_decode, input_ids) == holder
        two_decode.wait_idle()
        # both replicas' indexes hold the same blocks of each worker
        agreed = wait_for_indexes(kv_replicas, lambda b: b == index_blocks(kv_replicas[0]))
        assert agreed[holder] > prefix_blocks and agreed[other] == 0, agreed
        flush(holder)  # the next round plants it on the other worker: routing must follow the events
    two_decode.check_kv_conservation()


def test_an_adapters_prefix_goes_to_the_worker_that_cached_it(
    two_decode: Stack, kv_replicas: list[Stack], adapter_path: Path
) -> None:
    """Both workers hold the adapter in a slot, so only the cached prefix tells them apart; its KV
    sits under the adapter's namespace, whose hashes the replicas must chain from the adapter's
    name (from the base model's root every worker would score 0 and the turns alternate)."""
    addresses = decode_addresses(two_decode)
    http = httpx.Client(base_url=two_decode.base_url, timeout=300)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path": str(adapter_path)})
    assert r.status_code == 200, r.text
    try:
        tok = hf_tokenizer()
        assert all(resident(address) == [] for address in addresses)
        # one short request of the adapter on each worker (the launcher's gateway's round_robin)
        short = [served_by(two_decode, two_decode, tok(f"Ahoy {i}!")["input_ids"], ADAPTER) for i in range(2)]
        assert sorted(short) == sorted(addresses)
        assert all(resident(address) == [ADAPTER] for address in addresses)
        two_decode.wait_idle()
        for address in addresses:
            flush(address)
        wait_for_indexes(
            kv_replicas, lambda blocks: set(blocks) == set(addresses) and not any(blocks.values())
        )
        preamble = " ".join(f"Article {i}: the crew keeps this charter in every answer." for i in range(30))
        prefix = tok(preamble)["input_ids"]
        prompts = [prefix + tok(f" Question {i}: what does article {i} say?")["input_ids"] for i in range(3)]
        prefix_blocks = len(block_hashes(prefix, PAGE_SIZE))
        holder = served_by(kv_replicas[0], two_decode, prompts[0], ADAPTER)
        wait_for_indexes(kv_replicas, lambda b: b[holder] >= prefix_blocks)
        for i, input_ids in enumerate(prompts[1:] * 2):
            assert served_by(kv_replicas[i % 2], two_decode, input_ids, ADAPTER) == holder
    finally:
        two_decode.wait_idle()
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": ADAPTER})
        for address in addresses:
            flush(address)
    assert r.status_code == 200, r.text


async def test_an_index_that_cannot_be_trusted_is_routed_by_load_and_logged(
    two_decode: Stack, caplog
) -> None:
    tok = hf_tokenizer()
    live = served_by(two_decode, two_decode, tok("A prompt of a few whole pages. " * 8)["input_ids"])
    two_decode.wait_idle()
    dead = f"127.0.0.1:{free_port_block(1)}"  # nothing listens: its stream never opens
    pool = WorkerPool("decode", [live, dead])
    clients = BackendClients()
    indexes = KVIndexes(clients, pool, interval=0.2)
    policy = KVAwarePolicy(indexes, KVAwareWeights(lag_s=0.5))
    caplog.set_level(logging.INFO, logger="pdserve.services.gateway.routing.kv_index")
    indexes.start()
    try:
        while indexes.get(live).block_size is None:  # its snapshot has the prompt's blocks
            await asyncio.sleep(0.05)
        healthy, down = pool.workers
        healthy.in_flight, down.in_flight = 0, 3
        prompt = list(range(1, 40))  # two whole pages no worker holds
        assert all(policy.select(pool.workers, prompt) is healthy for _ in range(3))
        # less loaded: the unknown worker gets another prompt, by load (that one's pages are pending
        # on the live worker, which the requests above went to)
        healthy.in_flight, down.in_flight = 3, 0
        assert all(policy.select(pool.workers, list(range(100, 140))) is down for _ in range(3))
        # requests with pages it lacks went to the live worker (above), and no batch came: it lags
        await asyncio.sleep(0.7)
        assert policy.scores(pool.workers, prompt) == {live: -0.5, dead: 0.0}
        assert policy.scores(pool.workers, prompt) == {live: -0.5, dead: 0.0}
    finally:
        await indexes.stop()
        await clients.close()
    lines = [r.getMessage() for r in caplog.records if r.name.endswith(".kv_index")]
    assert len(lines) == 3, lines
    assert re.fullmatch(rf"decode worker {live}: KV index in step \(\d+ blocks\)", lines[0])
    assert lines[1] == f"decode worker {dead}: its KV event stream is down; routing it by load alone"
    assert re.fullmatch(
        rf"decode worker {live}: its KV events lag: none for [\d.]+ s since a request went there; "
        "routing it by load alone",
        lines[2],
    )
