"""``pdserve launch`` in a network namespace whose ephemeral port range is tiny and holds every fixed
port: the stack comes up every time.

The kernel draws the source port of every ``connect()`` (gRPC channels, health checks) and every
``bind()`` to port 0 (UCX's listeners) from ``net.ipv4.ip_local_port_range``. With 32 ports in the
range and 6 of them fixed ports of the stack, a connection made while a service is starting would
often take that service's port ("cannot listen on 127.0.0.1:<port>"), unless the launcher holds every
fixed port before anything starts (``services/launcher/ports.py``). Each attempt is one colocated start
(small KV pool) in a fresh process tree inside the namespace (``tests/launcher/netns_stack.py``); the
namespace is this test's own (``ip netns``, iproute2; root needed) and only its loopback is up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reference import chat_ids, hf_greedy, hf_tokenizer

REPO = Path(__file__).resolve().parents[2]
EPHEMERAL = (41000, 41031)
PORT = 41000  # HTTP; the public gRPC API on 41001
INTERNAL_BASE = 41002  # tokenizer 41003, detokenizer 41004, gateway (internal) 41005, decode-0 41022
ATTEMPTS = 3
QUESTION = "What is the capital of France?"
MAX_TOKENS = 8


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def netns() -> str:
    name = f"pdserve-test-{os.getpid()}"
    ip("netns", "add", name)
    try:
        ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        low, high = EPHEMERAL
        ip("netns", "exec", name, "sh", "-c", f"echo {low} {high} > /proc/sys/net/ipv4/ip_local_port_range")
        yield name
    finally:
        ip("netns", "delete", name)


def test_a_tiny_ephemeral_range_holding_the_fixed_ports_never_stops_the_stack(netns: str) -> None:
    ids = hf_greedy(chat_ids([{"role": "user", "content": QUESTION}]), MAX_TOKENS)
    expected = hf_tokenizer().decode(ids, skip_special_tokens=True)
    for attempt in range(ATTEMPTS):
        command = [
            "ip", "netns", "exec", netns, sys.executable, "-m", "tests.launcher.netns_stack",
            str(PORT), str(INTERNAL_BASE), f"netns-{attempt}", QUESTION, str(MAX_TOKENS),
        ]  # fmt: skip
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=420)
        assert result.returncode == 0, f"attempt {attempt}:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        outcome = json.loads(result.stdout.splitlines()[-1])
        assert outcome["answer"] == expected, attempt
        assert outcome["ephemeral_connections"] > 0  # the stack's own connections drew from the range
