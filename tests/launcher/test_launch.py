"""``pdserve launch`` with 1 prefill + 2 decode workers as real processes: start-up, serving, a crashed
decode-scheduler restarted by the launcher, and a SIGTERM that drains the gateway first (new requests
get a 503 meanwhile) and leaves no process behind. One stack for the whole module (it takes a minute
or two to start)."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.reference import chat_ids, hf_greedy, hf_tokenizer
from tests.stack import SERVED_MODEL, Stack, children, launch_stack, log_text, wait_for_log

MODEL = SERVED_MODEL
DRAIN_TIMEOUT = 20
FLAGS = (
    "--num-prefill", "1", "--num-decode", "2", "--router-policy", "round_robin",
    "--dtype", "float32", "--max-total-tokens", "16384", "--drain-timeout", str(DRAIN_TIMEOUT),
)  # fmt: skip
QUESTIONS = ["What is the capital of France?", "Name three fruits."]


@pytest.fixture(scope="module")
def stack() -> Stack:
    stack = launch_stack(*FLAGS, log_name="launcher")
    yield stack
    stack.stop()


def alive(proc: psutil.Process) -> bool:
    """Running and not a zombie."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def expected_answer(question: str, max_tokens: int = 24) -> str:
    """The HF reference's greedy answer."""
    return hf_tokenizer().decode(reference_ids(question, max_tokens), skip_special_tokens=True)


def reference_ids(question: str, max_tokens: int) -> list[int]:
    return hf_greedy(chat_ids([{"role": "user", "content": question}]), max_tokens)


def decode_tokens(stack: Stack) -> dict[str, float]:
    """Generated tokens per decode worker ("host:port") since its process started."""
    values = stack.scheduler_values("pdserve:generation_tokens_total")
    return {worker: v for (role, worker), v in values.items() if role == "decode"}


def test_every_role_comes_up_and_serves_greedy_chat(stack: Stack) -> None:
    base = stack.internal_port_base
    procs = children(stack)
    assert sorted(procs) == sorted(
        [f"tokenizer:{base + 1}", f"detokenizer:{base + 2}", f"prefill:{base + 10}"]
        + [f"decode:{base + 20}", f"decode:{base + 21}", f"gateway:{stack.port}"]
    )
    # each in its own process group, so a terminal's Ctrl-C reaches only the launcher
    assert all(p.pid == os.getpgid(p.pid) for p in procs.values())
    health = httpx.get(f"{stack.base_url}/health", timeout=10).json()
    assert health["status"] == "ok"
    assert set(health["roles"]["decode"].values()) == {"SERVING"} and len(health["roles"]["decode"]) == 2
    log = wait_for_log(stack, f"pdserve is up: OpenAI API at http://127.0.0.1:{stack.port}/v1")
    assert "[6/6] gateway ready" in log
    for question in QUESTIONS:  # round robin: one request on each decode worker
        assert stack.chat(question) == expected_answer(question)
    assert sorted(decode_tokens(stack)) == [f"127.0.0.1:{base + 20}", f"127.0.0.1:{base + 21}"]
    assert all(v > 0 for v in decode_tokens(stack).values())


def test_a_killed_decode_scheduler_is_restarted_and_serves_again(stack: Stack) -> None:
    key = f"decode:{stack.internal_port_base + 20}"
    address = f"127.0.0.1:{stack.internal_port_base + 20}"
    victim = children(stack)[key]
    victim.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    while True:
        assert time.monotonic() - t0 < 60, f"decode-0 not back after 60 s:\n{log_text(stack)[-4000:]}"
        restarted = children(stack).get(key)
        if restarted is not None and restarted.pid != victim.pid:
            health = httpx.get(f"{stack.base_url}/health", timeout=10).json()
            if health["roles"]["decode"][address] == "SERVING":
                break
        time.sleep(0.5)
    back_after = time.monotonic() - t0
    for question in QUESTIONS:  # round robin over both healthy workers: one lands on the new decode-0
        assert stack.chat(question) == expected_answer(question)
    assert decode_tokens(stack)[address] > 0  # counted by the new process
    log = wait_for_log(stack, f"decode-0 is back (pid {restarted.pid}")
    assert f"decode-0 (pid {victim.pid}) killed by SIGKILL" in log
    print(f"decode-0 restarted and healthy {back_after:.1f} s after SIGKILL")


def refused_while_draining(client: openai.OpenAI) -> openai.APIStatusError:
    """The error a new request gets once the gateway drains (a request the signal has not reached
    yet is served: try again)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
            )
        except openai.APIStatusError as e:
            return e
        time.sleep(0.1)
    raise AssertionError("the gateway kept serving new requests 10 s after SIGTERM")


def test_sigterm_drains_the_gateway_first_and_leaves_no_process(stack: Stack) -> None:
    launcher = psutil.Process(stack.proc.pid)
    tree = {p.pid: p for p in launcher.children(recursive=True)}
    gateway_pid = children(stack)[f"gateway:{stack.port}"].pid
    gone_at: dict[int, float] = {}
    watching = threading.Event()

    def watch() -> None:
        while len(gone_at) < len(tree) and not watching.is_set():
            for pid, proc in tree.items():
                if pid not in gone_at and not alive(proc):
                    gone_at[pid] = time.monotonic()
            time.sleep(0.02)

    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0)

    def stream(question: str, max_tokens: int, started: threading.Event) -> tuple[str, str | None]:
        """The streamed text and finish reason (None if the stream was cut off)."""
        text, finish = "", None
        try:
            for chunk in client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": question}],
                temperature=0,
                max_tokens=max_tokens,
                stream=True,
            ):
                started.set()
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
        except (openai.APIError, httpx.HTTPError):
            pass
        started.set()
        return text, finish

    short_started, long_started = threading.Event(), threading.Event()
    with ThreadPoolExecutor(3) as pool:
        long = pool.submit(stream, "Write a very long story about a dragon and a knight.", 2000, long_started)
        assert long_started.wait(120)
        short = pool.submit(stream, QUESTIONS[0], 8, short_started)
        assert short_started.wait(120)
        stack.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        watcher = pool.submit(watch)
        refused = refused_while_draining(client)
        assert refused.status_code == 503 and "shutting down" in refused.message
        assert refused.response.headers["retry-after"] == "1"
        health = httpx.get(f"{stack.base_url}/health", timeout=10)
        assert (health.status_code, health.json()) == (503, {"status": "draining"})
        with grpc.insecure_channel(stack.grpc_address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
        short_text, short_finish = short.result(timeout=DRAIN_TIMEOUT + 10)
        long_text, long_finish = long.result(timeout=DRAIN_TIMEOUT + 10)
        assert stack.proc.wait(timeout=DRAIN_TIMEOUT + 60) == 0
        exited_after = time.monotonic() - t0
        time.sleep(0.2)  # the launcher reaped every child before exiting: let the watcher see it
        watching.set()
        watcher.result()

    # the short request in flight was finished, not cut: same text as the HF reference
    ids = reference_ids(QUESTIONS[0], 8)
    finish = "stop" if ids[-1] == hf_tokenizer().eos_token_id else "length"
    assert (short_text, short_finish) == (expected_answer(QUESTIONS[0], 8), finish)
    # the gateway stopped before any other service was told to
    assert set(gone_at) == set(tree)
    assert gone_at[gateway_pid] <= min(t for pid, t in gone_at.items() if pid != gateway_pid)
    # nothing the launcher started survived it
    assert not [p for p in tree.values() if alive(p)]
    ports = {str(stack.port), *(str(stack.internal_port_base + k) for k in range(40))}
    leftovers = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "pdserve.cli" in cmd and "--port" in cmd and cmd[cmd.index("--port") + 1] in ports:
            leftovers.append(proc.info)
    assert leftovers == []
    print(f"exited {exited_after:.1f} s after SIGTERM; long stream: {long_finish}, {len(long_text)} chars")
