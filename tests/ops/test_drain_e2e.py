"""SIGTERM to a scheduler with requests in flight: they complete; the worker then exits and
``pdserve launch`` restarts it (each test waits for that, so the stack is whole again)."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil

from tests.ops.conftest import METRICS_OFFSETS, SERVED_NAMES, OpsStack
from tests.reference import hf_greedy
from tests.stack import children, wait_for_log


def worker_process(ops: OpsStack, role: str) -> psutil.Process:
    """The running ``pdserve <role>`` child of the launcher (PD 1+1: one per role)."""
    return children(ops.stack)[f"{role}:{ops.stack.internal_port_base + METRICS_OFFSETS[role]}"]


def wait_until_whole(ops: OpsStack, process: str, old: psutil.Process, timeout: float = 300) -> None:
    """``old`` (the launcher's ``process``) exited with status 0 — the launcher's log says so, as only
    a parent learns a status — and its restart serves requests again (gateway /health 200)."""
    old.wait(timeout=120)
    wait_for_log(ops.stack, f"{process} (pid {old.pid}) exited with code 0", timeout=30)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{ops.base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the stack did not come back after the worker's restart")


def stream_completion(
    ops: OpsStack, prompt: str | list[int], max_tokens: int, started: threading.Event
) -> dict:
    """A streamed completion (ignore_eos); sets ``started`` at its first chunk; returns the
    concatenated text, token count and finish reason."""
    body = {
        "model": SERVED_NAMES[0], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    out = {"text": "", "finish_reason": None, "completion_tokens": None, "error": None}
    with httpx.stream("POST", f"{ops.base_url}/v1/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["error"] = chunk["error"]
            for choice in chunk.get("choices", []):
                out["text"] += choice.get("text") or ""
                out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
                started.set()
            if chunk.get("usage"):
                out["completion_tokens"] = chunk["usage"]["completion_tokens"]
    return out


def drain_lines(ops: OpsStack, process: str) -> list[dict]:
    return [
        r for r in ops.log_records() if r.get("process") == process and r["message"].startswith("draining")
    ]


def test_sigterm_decode_worker_completes_its_requests(ops_stack: OpsStack) -> None:
    decode = worker_process(ops_stack, "decode")
    prompts = [f"Story {i}: the old lighthouse keeper" for i in range(4)]
    started = [threading.Event() for _ in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(stream_completion, ops_stack, p, 64, e) for p, e in zip(prompts, started, strict=True)
        ]
        assert all(e.wait(120) for e in started)
        decode.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = httpx.post(
            f"{ops_stack.base_url}/v1/completions",
            json={"model": SERVED_NAMES[0], "prompt": "too late", "max_tokens": 4},
            timeout=60,
        )
        results = [f.result(timeout=300) for f in futures]
    # a new request gets a clear, retryable refusal while the worker drains
    assert refused.status_code == 503 and "error" in refused.json(), refused.text
    for r in results:  # none was cut: every one got all its tokens
        assert (r["error"], r["finish_reason"], r["completion_tokens"]) == (None, "length", 64), r
    (line,) = drain_lines(ops_stack, "decode-0")
    assert line["message"].startswith("draining: new requests refused, 4 held")
    wait_until_whole(ops_stack, "decode-0", decode)


def test_sigterm_prefill_worker_finishes_the_prefills_it_owes(ops_stack: OpsStack) -> None:
    prefill = worker_process(ops_stack, "prefill")
    # long distinct prompts, so that the prefill worker holds several at once (fp32, 2 cores: seconds)
    prompts = [[100 + (7 * i + 13 * j) % 4000 for j in range(900)] for i in range(3)]
    started = [threading.Event() for _ in prompts]

    def prefill_queue() -> float:
        text = httpx.get(ops_stack.metrics_url("prefill"), timeout=10).text
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith(("pdserve:num_running_reqs{", "pdserve:num_queue_reqs{"))
        )

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(stream_completion, ops_stack, p, 8, e) for p, e in zip(prompts, started, strict=True)
        ]
        deadline = time.monotonic() + 120
        while prefill_queue() < 2:  # SIGTERM while it owes at least two prefills
            assert time.monotonic() < deadline, "the prefill worker never held two prefills at once"
            time.sleep(0.05)
        prefill.send_signal(signal.SIGTERM)
        results = [f.result(timeout=300) for f in futures]
    for r in results:
        assert (r["error"], r["finish_reason"], r["completion_tokens"]) == (None, "length", 8), r
    (line,) = drain_lines(ops_stack, "prefill-0")
    held = int(line["message"].split(", ")[1].split()[0])
    assert held >= 2, line  # it owed prefills when it was told to stop, and finished them
    # the KV the draining worker wrote is right: greedy tokens equal HF transformers'
    reference = hf_greedy(prompts[0], 8)  # stops early only at EOS, which the server ignored
    expected = httpx.post(f"{ops_stack.base_url}/detokenize", json={"tokens": reference}, timeout=30)
    assert results[0]["text"].startswith(expected.json()["prompt"]) and len(reference) >= 4
    wait_until_whole(ops_stack, "prefill-0", prefill)
