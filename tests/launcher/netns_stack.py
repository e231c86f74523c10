"""Run by ``test_netns`` inside a network namespace: start a colocated stack on the given fixed ports,
answer one greedy chat, check the KV pool, stop it. Prints one JSON line: the answer and how many of
the stack's connections had a local port from the namespace's ephemeral range (so the range was used).

Usage: ``python -m tests.launcher.netns_stack PORT INTERNAL_PORT_BASE LOG_NAME QUESTION MAX_TOKENS``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil

from tests.stack import launch_stack


def ephemeral_range() -> range:
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(low, high + 1)


def main() -> None:
    port, base, log_name, question, max_tokens = sys.argv[1:]
    stack = launch_stack(
        "--colocated", "--dtype", "float32", "--max-total-tokens", "2048",
        port=int(port), internal_port_base=int(base), log_name=log_name, timeout=300,
    )  # fmt: skip
    try:
        answer = stack.chat(question, max_tokens=int(max_tokens))
        stack.check_kv_conservation()
        ephemeral = ephemeral_range()
        in_range = [
            c.laddr.port
            for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_ESTABLISHED and c.laddr.port in ephemeral
        ]
    finally:
        stack.stop()
    print(json.dumps({"answer": answer, "ephemeral_connections": len(in_range)}))


if __name__ == "__main__":
    main()
