"""Workers that hang or die, under load, in PD mode (2 prefill + 1 decode, real processes).

- A prefill worker is SIGSTOPped while clients keep sending: every client gets its answer (the
  decode worker gives up the hung worker's prefills after ``PDSERVE_PREFILL_DEAD_AFTER`` and retries
  them on the other one) or a clear error, within 10 s; the launcher kills the hung worker once its
  liveness check has failed for ``--liveness-timeout`` and restarts it.
- The decode worker is SIGKILLed with streams in flight: the streams end with a clear error, the
  detokenizer and the gateway drop every request's state, and the restarted decode worker has the KV
  pool of its first start although the pool is sized from free memory and 1 GiB less is free now.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from tests.reference import chat_ids, hf_greedy, hf_tokenizer
from tests.stack import SERVED_MODEL, Stack, children, launch_stack, log_text, wait_for_log

LIVENESS_TIMEOUT = 5.0
PREFILL_DEAD_AFTER = 2.5
ANSWER_WITHIN = 10.0
QUESTION = "What is the capital of France?"
MAX_TOKENS = 8
CLIENTS = 4
FLAGS = (
    "--num-prefill", "2", "--num-decode", "1", "--router-policy", "round_robin", "--dtype", "float32",
    "--kv-memory-fraction", "0.03", "--liveness-timeout", str(LIVENESS_TIMEOUT),
)  # fmt: skip


@pytest.fixture(scope="module")
def stack() -> Stack:
    env = {"PDSERVE_PREFILL_DEAD_AFTER": str(PREFILL_DEAD_AFTER)}
    stack = launch_stack(*FLAGS, log_name="hung-workers", env=env)
    yield stack
    stack.stop()


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0, timeout=120)


def expected_answer() -> str:
    ids = hf_greedy(chat_ids([{"role": "user", "content": QUESTION}]), MAX_TOKENS)
    return hf_tokenizer().decode(ids, skip_special_tokens=True)


def ask(api: openai.OpenAI) -> tuple[float, float, int, str]:
    """``(start, end, status, answer or error message)`` of one greedy chat."""
    start = time.monotonic()
    try:
        resp = api.chat.completions.create(
            model=SERVED_MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
    except openai.APIStatusError as e:
        return start, time.monotonic(), e.status_code, e.message
    return start, time.monotonic(), 200, resp.choices[0].message.content


def wait_back(stack: Stack, name: str, pid: int, timeout: float = 300) -> None:
    """Until the launcher logged ``name`` back and /health lists every worker SERVING."""
    wait_for_log(stack, f"{name} is back", timeout)
    assert children(stack)[f"{name.split('-')[0]}:{port_of(stack, name)}"].pid != pid
    deadline = time.monotonic() + 60
    while httpx.get(f"{stack.base_url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, httpx.get(f"{stack.base_url}/health", timeout=10).text
        time.sleep(0.5)


def port_of(stack: Stack, name: str) -> int:
    role, index = name.split("-")
    return stack.internal_port_base + (10 if role == "prefill" else 20) + int(index)


def test_a_stopped_prefill_worker_under_load(stack: Stack) -> None:
    expected = expected_answer()
    api = client(stack)
    assert [ask(api)[3] for _ in range(2)] == [expected, expected]  # both prefill workers serve
    victim = children(stack)[f"prefill:{port_of(stack, 'prefill-0')}"]
    done = threading.Event()

    def keep_asking() -> list[tuple[float, float, int, str]]:
        results = []
        while not done.is_set():
            results.append(ask(api))
        return results

    with ThreadPoolExecutor(CLIENTS) as pool:
        workers = [pool.submit(keep_asking) for _ in range(CLIENTS)]
        time.sleep(3)
        victim.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        time.sleep(2 * ANSWER_WITHIN)
        done.set()
        results = [r for w in workers for r in w.result()]

    after = [r for r in results if r[1] > stopped]  # requests in flight at the SIGSTOP or sent after
    slowest = max(end - start for start, end, _, _ in after)
    statuses = sorted({status for _, _, status, _ in results})
    errors = {text for _, _, status, text in results if status != 200}
    print(
        f"\n{len(results)} requests ({len(after)} after the SIGSTOP), statuses {statuses}, "
        f"slowest after the SIGSTOP {slowest:.1f} s, errors: {errors}"
    )
    assert slowest <= ANSWER_WITHIN, slowest
    for _, _, status, text in results:
        assert (status, text) == (200, expected) or (status == 503 and "retry" in text), (status, text)
    log = log_text(stack)
    assert "did not answer its health checks" in log  # a prefill was given up on the hung worker...
    assert sum(1 for r in after if r[2] == 200) >= CLIENTS  # ...and answered by the other one

    killed = wait_for_log(stack, f"prefill-0 (pid {victim.pid}) did not answer its liveness check", 60)
    assert f"prefill-0 (pid {victim.pid}) killed by SIGKILL" in killed
    wait_back(stack, "prefill-0", victim.pid)
    assert [ask(api)[3] for _ in range(4)] == [expected] * 4  # round robin: 2 on the new prefill-0
    tokens = stack.scheduler_values("pdserve:prompt_tokens_total")
    assert tokens[("prefill", f"127.0.0.1:{port_of(stack, 'prefill-0')}")] > 0
    stack.check_kv_conservation()


def test_a_killed_decode_worker_leaves_no_state_and_comes_back_with_its_pool(stack: Stack) -> None:
    totals = stack.scheduler_values("pdserve:kv_pages_total")
    decode_key = ("decode", f"127.0.0.1:{port_of(stack, 'decode-0')}")
    first_pool = totals[decode_key]
    api = client(stack)
    started = threading.Barrier(CLIENTS + 1)

    def stream() -> tuple[float, str]:
        """Seconds from the kill to the stream's end, and how it ended."""
        chunks = api.chat.completions.create(
            model=SERVED_MODEL,
            messages=[{"role": "user", "content": "Write a long story about the sea."}],
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first = True
        try:
            for _ in chunks:
                if first:
                    first = False
                    started.wait(120)
        except openai.APIError as e:
            return time.monotonic(), e.message
        return time.monotonic(), "finished"

    ballast = torch.ones(1 << 30, dtype=torch.uint8)  # 1 GiB less free memory for the restart
    try:
        victim = children(stack)[f"decode:{port_of(stack, 'decode-0')}"]
        with ThreadPoolExecutor(CLIENTS) as pool:
            streams = [pool.submit(stream) for _ in range(CLIENTS)]
            started.wait(120)
            victim.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            ends = [s.result(timeout=60) for s in streams]
        ended_after = max(end for end, _ in ends) - killed
        assert ended_after <= ANSWER_WITHIN, ends
        assert all("went away" in how or "went down" in how for _, how in ends), ends
        deadline = time.monotonic() + ANSWER_WITHIN
        while True:
            m = stack.metrics()
            state = (
                sum(m.get("pdserve:detokenizer_active_streams", {}).values()),
                sum(m["pdserve:gateway_in_flight_requests"].values()),
            )
            if state == (0, 0):
                break
            assert time.monotonic() < deadline, f"detokenizer streams, gateway requests: {state}"
            time.sleep(0.2)
        no_state_after = time.monotonic() - killed
        wait_back(stack, "decode-0", victim.pid)
    finally:
        del ballast
    assert stack.scheduler_values("pdserve:kv_pages_total")[decode_key] == first_pool
    tokens = int(first_pool * 16)
    assert f"decode-0 has a KV pool of {tokens} tokens; a restart gets the same" in log_text(stack)
    assert ask(client(stack))[2:] == (200, expected_answer())
    stack.check_kv_conservation()
    print(
        f"\nstreams ended {ended_after:.1f} s after the SIGKILL ({ends[0][1]!r}); no detokenizer or "
        f"gateway state {no_state_after:.1f} s after it; decode pool {first_pool:.0f} pages before and after"
    )
