"""Issue 21 on the real stack: a scheduler of two tensor-parallel ranks (gloo, two processes each),
colocated and in PD (prefill rank i writes its KV heads into decode rank i over NIXL; the decode
group speculates with n-gram drafts, issue 38), gives HF's greedy tokens through chunked prefill,
radix hits, retraction and aborts, with every scheduler's ranks comparing their state digests after
every step and every pool conserved; a killed rank takes its group down, every client gets an
answer within 10 s, and the group restarts and serves again; a prefill worker whose KV heads cannot
pair with the decode worker's is refused at the handshake, naming both sides' TP sizes and heads; a
constrained request is a clear 400; two LoRA adapters loaded at run time reach every rank at the
same step and give HF PEFT's tokens in one batch with the base model until they are unloaded."""

from __future__ import annotations

import asyncio
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import psutil
import pytest
import torch

from pdserve.services.common.grammar_wait import GRAMMAR_UNDER_TP
from tests.lora.adapters import make_adapters, peft_greedy
from tests.pd.handshake import refused_handshake
from tests.reference import chat_ids, hf_greedy
from tests.stack import SERVED_MODEL, Stack, launch_stack
from tests.tp.helpers import (
    check_aborts,
    check_chunked_prefill_and_radix_hit,
    check_greedy_equals_hf,
    check_group,
    check_retraction,
    generate,
    tp_state_checks,
)

# a small pool (64 pages) so that eight growing requests must retract; small chunks so prompts chunk
COMMON = (
    "--tp-size",
    "2",
    "--dtype",
    "float32",
    "--max-total-tokens",
    "1024",
    "--chunked-prefill-size",
    "64",
    "--enable-lora",
    "--max-lora-rank",
    "8",
    "--max-loras",
    "2",
    "--max-loaded-loras",
    "2",
)
# PD's decode group also speculates (n-gram drafts, the adaptive policy): every rank must draft,
# time its steps and verify identically, which the state digests check after every step
SPECULATIVE = ("--speculative-algorithm", "ngram")
MODES = {
    "colocated": ("--colocated", *COMMON),
    "pd": ("--num-prefill", "1", "--num-decode", "1", *COMMON, *SPECULATIVE),
}


WATCHDOG_S = 3.0  # the schedulers' --tp-watchdog (through the environment the launcher passes on)


@pytest.fixture(scope="module", params=sorted(MODES))
def tp_stack(request: pytest.FixtureRequest) -> Stack:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PDSERVE_TP_WATCHDOG", str(WATCHDOG_S))
        stack = launch_stack(*MODES[request.param], log_name=f"tp-{request.param}")
    stack.extra["speculative"] = "--speculative-algorithm" in MODES[request.param]
    yield stack
    stack.stop()


@pytest.fixture
def tp(tp_stack: Stack) -> Stack:
    before = tp_state_checks(tp_stack)
    yield tp_stack
    check_group(tp_stack, before)


def spec_drafts(stack: Stack) -> float:
    """Verify steps of every scheduler (the decode group's, where it speculates)."""
    return sum(stack.scheduler_values("pdserve:spec_decode_num_drafts_total").values())


def test_greedy_equals_hf(tp):
    drafts_before = spec_drafts(tp)
    check_greedy_equals_hf(tp)
    if tp.extra["speculative"]:  # its verify steps ran, on both ranks alike
        assert spec_drafts(tp) > drafts_before


def test_chunked_prefill_and_radix_hit(tp):
    check_chunked_prefill_and_radix_hit(tp)


def test_retraction(tp):
    # 8 x 11 pages at the end in a 64-page pool: retraction even when PD prefills spread the starts
    check_retraction(tp, requests=8, prompt_len=110, new_tokens=64)


def test_aborted_streams(tp):
    check_aborts(tp)


def test_constrained_request_is_refused_clearly(tp):
    """Grammars compile per rank process, at moments the ranks would not agree on: under TP a
    constrained request is a 400 naming the limitation, and the stack keeps serving."""
    client = openai.OpenAI(
        base_url=f"{tp.base_url}/v1", api_key="none", max_retries=0, http_client=httpx.Client(timeout=60)
    )
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=SERVED_MODEL,
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=8,
            response_format={"type": "json_object"},
        )
    assert GRAMMAR_UNDER_TP in err.value.body["message"], err.value.body
    assert tp.chat("Name a colour.", max_tokens=4)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """The fp32 PEFT model holding two random adapters of SmolLM2, and their directories."""
    torch.set_num_threads(1)  # the CI machine is shared: one thread avoids OpenMP spin-waits
    model, paths = make_adapters(tmp_path_factory.mktemp("tp-adapters"))
    yield model, paths
    del model


def test_lora_adapters_loaded_at_run_time(tp, adapters):
    """A load travels to every rank as a step input (as new requests do), so all ranks hold their
    slices of an adapter from the same step; both run in one batch with the base model, then are
    unloaded. A third is over --max-loaded-loras 2: every rank refuses it alike (the ranks' states are
    compared after every step), a 429."""
    peft_model, paths = adapters
    http = httpx.Client(base_url=tp.base_url, timeout=600)
    for name, path in paths.items():
        r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 200, r.text
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": str(path)})
    assert r.status_code == 429 and "--max-loaded-loras 2" in r.json()["error"]["message"], r.text
    ids = chat_ids([{"role": "user", "content": "Name three animals that live in the ocean."}])
    sampling = {"temperature": 0, "max_new_tokens": 12}

    def one(model: str | None) -> list[int]:
        body = {"input_ids": ids, "model": model, "sampling_params": sampling}
        resp = httpx.post(f"{tp.base_url}/generate", json=body, timeout=600)
        assert resp.status_code == 200, resp.text
        return resp.json()["output_ids"]

    models = [*paths, None]
    with ThreadPoolExecutor(len(models)) as pool:
        outputs = list(pool.map(one, models))
    assert outputs == [peft_greedy(peft_model, name, ids, 12) for name in models]
    assert len({tuple(out) for out in outputs}) == len(models)  # each adapter changes the tokens
    tp.wait_idle()
    for name in paths:
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": name})
        assert r.status_code == 200, r.text


def _rank1(stack: Stack) -> psutil.Process:
    """The decode service's TP rank 1: the child process its rank 0 spawned."""
    port = stack.internal_port_base + 20
    pids = subprocess.run(
        ["pgrep", "-f", f"pdserve.cli decode .*--port {port}"], capture_output=True, text=True
    )
    rank0 = psutil.Process(int(pids.stdout.split()[0]))
    # spawn_main: the rank itself, not multiprocessing's resource tracker beside it
    (rank1,) = [c for c in rank0.children() if "spawn_main" in " ".join(c.cmdline())]
    return rank1


@pytest.mark.parametrize("tp_stack", ["colocated"], indirect=True)
@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_failed_rank_ends_every_request_and_the_group_restarts(tp_stack, fault):
    """Rank 1 killed (its death is seen at once) or stopped (its heartbeat goes silent for the
    watchdog's 3 s): every client is answered within 10 s, /health shows the group down, and the
    restarted group serves HF's tokens again."""
    stack = tp_stack
    ids = chat_ids([{"role": "user", "content": "Tell me a long story about the sea."}])
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True},
    }

    async def load() -> tuple[float, list[tuple[float, httpx.Response]]]:
        async with httpx.AsyncClient(timeout=60) as client:

            async def one() -> tuple[float, httpx.Response]:
                resp = await client.post(f"{stack.base_url}/generate", json=body)
                return time.monotonic(), resp

            calls = [asyncio.create_task(one()) for _ in range(6)]
            await asyncio.sleep(3.0)  # the six are decoding
            failed = time.monotonic()
            if fault == "killed":
                _rank1(stack).kill()
            else:
                _rank1(stack).suspend()  # SIGSTOP: alive, silent
            return failed, await asyncio.gather(*calls)

    failed, answers = asyncio.run(load())
    for answered, resp in answers:
        assert answered - failed < 10, f"answered {answered - failed:.1f} s after rank 1 {fault}"
        if resp.status_code == 200:  # ended with an error finish reason and the reason
            assert resp.json()["meta_info"]["finish_reason"]["type"] == "error", resp.text
        # the group's own error, or the gateway's when it saw the worker go down first
        assert any(s in resp.text for s in ("TP", "scheduler", "went down")), resp.text
    unhealthy_seen = False
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status = httpx.get(f"{stack.base_url}/health", timeout=5).status_code
        unhealthy_seen |= status != 200
        if unhealthy_seen and status == 200:
            break
        time.sleep(0.5)
    assert unhealthy_seen, "/health never showed the scheduler group down"
    first = chat_ids([{"role": "user", "content": "What is the capital of France?"}])
    assert generate(stack, first)["output_ids"] == hf_greedy(first, 24)
    check_group(stack, 0)


def test_handshake_whose_heads_cannot_pair_fails_clearly(tmp_path):
    """A TP=1 decode worker's agent of a model with 4 KV heads offered to a TP=2 prefill worker of
    SmolLM2 (3): refused, naming the difference and both sides' TP sizes and head ranges (TP sizes
    that differ alone are paired by head slices: tests/tp/test_hetero_tp_stacks.py)."""
    err = refused_handshake(tmp_path, "--tp-size", "2", kv_heads=4)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = err.details()
    assert "total_kv_heads: decode 4, prefill 3" in details, details
    assert "decode TP=1 holds KV heads [0, 4); prefill TP=2 holds [0, 2), [2, 3)" in details, details
