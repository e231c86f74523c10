"""The `helm test` Pod's script (files/chat_smoke_test.py) against a real gateway (`pdserve launch`)."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

from tests.deploy.conftest import CHART_DIR
from tests.stack import Stack

SCRIPT = (CHART_DIR / "files" / "chat_smoke_test.py").read_text()


def run_script(base_url: str, max_tokens: int = 8) -> subprocess.CompletedProcess[str]:
    """Run the script the way the Pod does: ``python -c <script>`` with the Pod's environment."""
    env = {**os.environ, "PDSERVE_TEST_URL": base_url, "PDSERVE_TEST_MAX_TOKENS": str(max_tokens)}
    env.pop("PDSERVE_API_KEY", None)
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)


def test_chat_check_passes_and_reports_the_gateways_greedy_answer(colocated_stack: Stack) -> None:
    result = run_script(colocated_stack.base_url)
    assert result.returncode == 0, result.stderr
    model = httpx.get(f"{colocated_stack.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    answer = httpx.post(f"{colocated_stack.base_url}/v1/chat/completions", json=body, timeout=120).json()
    text = answer["choices"][0]["message"]["content"]
    assert any(ch.isalpha() for ch in text)
    assert result.stdout.strip() == f"{model} answered {text!r}"


def test_chat_check_fails_when_the_gateway_is_unreachable(colocated_stack: Stack) -> None:
    # The gateway's gRPC port speaks no HTTP/1.1: the script must fail, not pass silently.
    result = run_script(f"http://127.0.0.1:{colocated_stack.grpc_port}")
    assert result.returncode != 0
