"""A gateway replica killed with requests in flight leaves no work running and no state behind.

A third, throwaway ``pdserve gateway`` (round_robin, so its requests land on both decode workers)
joins the two-decode backend. Long streaming completions (``ignore_eos``) go through it; once their
tokens flow it is SIGKILLed. Its outputs then have nowhere to go: the detokenizer's stream to it cannot
reconnect, so within its ``--gateway-dead-after`` (3 s by default) the detokenizer aborts every rid it
holds for that replica at their decode-schedulers and drops their decode states. Both workers must be
idle with their KV pools conserved within a few seconds, having generated far fewer tokens than the
requests asked for, and the surviving replicas must still answer like the HF reference.
"""

from __future__ import annotations

import threading
import time

import openai
import pytest

from tests.gateway.replicas.conftest import start_gateway
from tests.reference import chat_ids, hf_greedy, hf_tokenizer
from tests.stack import SERVED_MODEL, Stack

MODEL = SERVED_MODEL
NUM_STREAMS = 4
MAX_TOKENS = 400
DEAD_AFTER = 3.0  # the detokenizer's default --gateway-dead-after
IDLE_WITHIN = DEAD_AFTER + 7.0  # plus the kill being noticed, the Abort calls and a step


@pytest.fixture(scope="module")
def doomed_gateway(two_decode_stack: Stack) -> Stack:
    gateway = start_gateway(two_decode_stack, "--router-policy", "round_robin", log_name="gateway-doomed")
    yield gateway
    gateway.stop()


class Streams:
    """``NUM_STREAMS`` streaming completions through one gateway, each read on its own thread."""

    def __init__(self, base_url: str) -> None:
        self.client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
        self.chunks = [0] * NUM_STREAMS
        self.finish_reasons: list[str | None] = [None] * NUM_STREAMS
        self.errors: list[Exception | None] = [None] * NUM_STREAMS
        self.threads = [
            threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(NUM_STREAMS)
        ]
        for t in self.threads:
            t.start()

    def _read(self, i: int) -> None:
        try:
            stream = self.client.completions.create(
                model=MODEL,
                prompt=f"Doomed story {i}: once upon a time, far across the sea,",
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                self.chunks[i] += 1
                self.finish_reasons[i] = chunk.choices[0].finish_reason if chunk.choices else None
        except (openai.APIError, openai.APIConnectionError) as e:
            self.errors[i] = e

    def wait_flowing(self, chunks: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while min(self.chunks) < chunks:
            assert time.monotonic() < deadline, f"tokens did not flow: {self.chunks} {self.errors}"
            time.sleep(0.05)

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a stream outlived its gateway"


def scheduler_sum(stack: Stack, name: str) -> dict[str, float]:
    """``{worker: value}`` of a scheduler metric."""
    return {worker: v for (_, worker), v in stack.scheduler_values(name).items()}


def active_rids(stack: Stack) -> float:
    return sum(stack.metrics().get("pdserve:detokenizer_active_streams", {}).values())


def test_killed_gateway_leaves_no_work_and_no_state(
    two_decode: Stack, cache_aware_gateway: Stack, doomed_gateway: Stack
) -> None:
    backend = two_decode
    generated_before = sum(scheduler_sum(backend, "pdserve:generation_tokens_total").values())
    streams = Streams(doomed_gateway.base_url)
    streams.wait_flowing(chunks=3, timeout=120)

    running = scheduler_sum(backend, "pdserve:num_running_reqs")
    assert len(running) == 2 and all(n > 0 for n in running.values()), running  # both workers busy
    assert sum(running.values()) == NUM_STREAMS
    assert active_rids(backend) == NUM_STREAMS

    doomed_gateway.proc.kill()
    killed = time.monotonic()
    doomed_gateway.proc.wait()
    streams.join(timeout=30)
    assert all(r is None for r in streams.finish_reasons), streams.finish_reasons  # none completed
    assert all(e is not None for e in streams.errors)

    # a request left running would take about a minute more
    backend.wait_idle(timeout=max(0.0, killed + IDLE_WITHIN - time.monotonic()))
    backend.check_kv_conservation()
    assert active_rids(backend) == 0  # the detokenizer dropped their decode states
    generated = sum(scheduler_sum(backend, "pdserve:generation_tokens_total").values()) - generated_before
    # aborted, not run to the end: the requests asked for NUM_STREAMS * MAX_TOKENS tokens
    assert 0 < generated < NUM_STREAMS * MAX_TOKENS / 2, generated

    # the surviving replicas still answer, like the HF reference
    question = "What is the capital of France?"
    reference = hf_greedy(chat_ids([{"role": "user", "content": question}]), 12)
    expected = hf_tokenizer().decode(reference, skip_special_tokens=True)
    for gateway in (backend, cache_aware_gateway):
        assert gateway.chat(question, 12) == expected
