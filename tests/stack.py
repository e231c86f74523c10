"""Launch a real pdserve topology (``pdserve launch``) for tests and read its metrics."""

from __future__ import annotations

import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import psutil
from prometheus_client.parser import text_string_to_metric_families

SERVED_MODEL = "SmolLM2-135M-Instruct"  # the id the default model is served under


def free_port_block(size: int) -> int:
    """A base port such that base .. base+size-1 are all free on 127.0.0.1, chosen outside the
    kernel's ephemeral range (``net.ipv4.ip_local_port_range``): a port in it, free when checked,
    can be handed to any process's ``connect()`` or ``bind(port 0)`` (gRPC clients, UCX listeners)
    before the service that is given it binds it. Pods started without the launcher's port
    reservation (tests/deploy) rely on this."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    candidates = [*range(10_000, low - size), *range(high + 1, 65_000 - size)]
    for base in random.sample(candidates, min(200, len(candidates))):
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + size):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free port block")


@dataclass
class Stack:
    """A running ``pdserve launch`` process tree."""

    proc: subprocess.Popen
    port: int
    grpc_port: int
    internal_port_base: int
    log_path: str
    extra: dict = field(default_factory=dict)
    tls_ca: str | None = None  # the CA of the gateway's certificate when it serves HTTPS

    @property
    def base_url(self) -> str:
        return f"{'https' if self.tls_ca else 'http'}://127.0.0.1:{self.port}"

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """httpx's ``verify`` for the gateway: trust its CA under TLS."""
        return ssl.create_default_context(cafile=self.tls_ca) if self.tls_ca else True

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def chat(self, question: str, max_tokens: int = 24) -> str:
        """A greedy one-turn chat through the official ``openai`` client; returns the answer text."""
        client = openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key="none",
            max_retries=0,
            http_client=httpx.Client(verify=self.verify, timeout=600),
        )
        resp = client.chat.completions.create(
            model=SERVED_MODEL,
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=max_tokens,
        )
        return resp.choices[0].message.content

    def metrics(self, by: tuple[str, ...] = ("role", "worker")) -> dict[str, dict[tuple, float]]:
        """``{metric sample name: {(role, worker): value}}`` from the gateway's /metrics; ``by``
        names other labels to key the values by (samples alike in them are summed)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10, verify=self.verify).text
        out: dict[str, dict[tuple, float]] = defaultdict(dict)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = tuple(sample.labels.get(label, "") for label in by)
                out[sample.name][key] = out[sample.name].get(key, 0.0) + sample.value
        return out

    def scheduler_values(self, name: str) -> dict[tuple, float]:
        return {
            k: v for k, v in self.metrics().get(name, {}).items() if k[0] in ("prefill", "decode", "mixed")
        }

    def wait_idle(self, timeout: float = 10.0) -> dict[str, dict[tuple, float]]:
        """Wait until no scheduler has running requests or used pages; return the last metrics.

        Raises AssertionError if that does not happen within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = {
                name: {k: v for k, v in m.get(name, {}).items() if v}
                for name in ("pdserve:num_running_reqs", "pdserve:num_queue_reqs", "pdserve:kv_pages_used")
            }
            if not any(busy.values()):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"stack not idle after {timeout} s: {busy}")
            time.sleep(0.1)

    def check_kv_conservation(self) -> None:
        """free + cached + used == total on every scheduler, in both page spaces of an SWA pool (and
        nothing used when idle)."""
        m = self.wait_idle()
        totals = m["pdserve:kv_pages_total"]
        assert totals, "no scheduler reported kv_pages_total"
        for key, total in totals.items():
            parts = [m[f"pdserve:kv_pages_{p}"][key] for p in ("free", "cached", "used")]
            assert sum(parts) == total, f"{key}: free+cached+used = {parts} != total {total}"
        for key, total in m.get("pdserve:swa_pages_total", {}).items():  # an SWA pool's local pages
            parts = [m[f"pdserve:swa_pages_{p}"][key] for p in ("free", "cached", "used")]
            assert sum(parts) == total and parts[2] == 0, f"{key}: local pages free+cached+used = {parts}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _services_started(log_path: str) -> bool:
    """Whether the launcher has started its first service (so it holds every fixed port)."""
    with open(log_path) as f:
        log = f.read()
    return " started " in log or '"message": "started ' in log  # --log-format text or json


def children(stack: Stack) -> dict[str, psutil.Process]:
    """The launcher's running services by ``role:port`` ("decode:30020"); not dead or unborn ones."""
    out = {}
    for proc in psutil.Process(stack.proc.pid).children():
        try:
            cmd = proc.cmdline()  # empty for a zombie; the launcher's own between fork and exec
        except psutil.Error:
            continue
        if "pdserve.cli" in cmd and cmd[cmd.index("pdserve.cli") + 1] != "launch":
            out[f"{cmd[cmd.index('pdserve.cli') + 1]}:{cmd[cmd.index('--port') + 1]}"] = proc
    return out


def log_text(stack: Stack) -> str:
    """The launcher's log (its own lines and every service's output) so far."""
    with open(stack.log_path) as f:
        return f.read()


def wait_for_log(stack: Stack, text: str, timeout: float = 30.0) -> str:
    """The launcher's log once it contains ``text``; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while text not in (log := log_text(stack)):
        assert time.monotonic() < deadline, f"{text!r} not in the log:\n{log[-4000:]}"
        time.sleep(0.2)
    return log


def launch_stack(
    *flags: str,
    log_name: str = "stack",
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
    tls_ca: str | None = None,
    port: int | None = None,
    internal_port_base: int | None = None,
    python: str = sys.executable,
) -> Stack:
    """Run ``pdserve launch`` with ``flags`` (and ``env`` added to this environment) and wait for a
    healthy /health (over HTTPS verified with ``tls_ca`` when given). HTTP on ``port`` and gRPC on
    ``port + 1``, internal ports from ``internal_port_base`` (each service's metrics port 100 above
    its internal port, the gateway's at base + 103); free ones where not given. ``python`` is the
    interpreter (whose pdserve runs).

    Raises RuntimeError with the tail of the log if the stack does not come up.
    """
    port = port or free_port_block(2)
    base = internal_port_base or free_port_block(140)  # the metrics ports are base + 100 + offset
    log_dir = os.environ.get("PDSERVE_TEST_LOG_DIR", "/tmp/pdserve-test-logs")
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"{log_name}.log")
    log = open(log_path, "w")  # noqa: SIM115 -- lives as long as the stack
    cmd = [
        python, "-m", "pdserve.cli", "launch",
        "--port", str(port), "--grpc-port", str(port + 1),
        "--internal-port-base", str(base), *flags,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    stack = Stack(proc, port, port + 1, base, log_path, tls_ca=tls_ca)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if not _services_started(log_path):
            # Not one connection before the launcher holds its fixed ports: a connect() to a port in
            # the ephemeral range that nothing listens on may draw that same port as its source and
            # connect to itself, leaving a TIME_WAIT that keeps the gateway off its port for 60 s.
            time.sleep(0.2)
            continue
        try:
            if httpx.get(f"{stack.base_url}/health", timeout=2, verify=stack.verify).status_code == 200:
                return stack
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stack.stop()
    with open(log_path) as f:
        tail = f.read()[-6000:]
    raise RuntimeError(f"pdserve launch {' '.join(flags)} did not become healthy:\n{tail}")
