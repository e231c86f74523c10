"""Two gateway replicas behind nginx (``deploy/nginx/pdserve.conf.template``) serve one backend.

The backend is ``pdserve launch --colocated --num-decode 2`` (its own gateway is one replica); a second
``pdserve gateway`` joins it. nginx (the Debian package, ``deploy/nginx/install.sh``) runs as a child of
the test with its own prefix, pid, temp and log files in a temporary directory. Expected outputs come
from the HF reference and from a gateway asked directly; which replica served what comes from each
replica's own request counter and from nginx's access log. Every test leaves both decode workers
idle with their KV pools conserved (``two_decode``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import string
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.reference import chat_ids, hf_greedy, hf_tokenizer
from tests.stack import Stack, free_port_block

MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = Path(__file__).parents[3] / "deploy" / "nginx" / "pdserve.conf.template"
QUESTIONS = ["Name one fruit.", "What colour is the sky?", "Say hello.", "Count to three."]
MAX_TOKENS = 12

# The test's own nginx.conf: everything nginx writes stays in its prefix directory.
MAIN_CONF = """\
{user}
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log notice;
events {{ worker_connections 256; }}
http {{
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    include {prefix}/pdserve.conf;
}}
"""


@dataclass
class Nginx:
    proc: subprocess.Popen
    port: int
    access_log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def upstreams(self, rids: list[str]) -> dict[str, str]:
        """rid -> the replica (``host:port``) nginx passed it to, from the access log.

        nginx writes a line just after it responds, so this waits (up to 5 s, then AssertionError)
        until every rid has its line.
        """
        deadline = time.monotonic() + 5
        while True:
            log = self.access_log.read_text()
            by_rid = {rid: upstream for upstream, rid in re.findall(r"upstream=(\S+) rid=(\S+)", log)}
            if all(r in by_rid for r in rids) or time.monotonic() > deadline:
                return {r: by_rid.get(r, "") for r in rids}
            time.sleep(0.02)


def nginx_binary() -> str:
    """nginx from PATH or /usr/sbin; ``deploy/nginx/install.sh`` installs it (``make install`` runs it)."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    assert found, "nginx is not installed: run deploy/nginx/install.sh"
    return found


def start_nginx(prefix: Path, gateways: list[Stack]) -> Nginx:
    """Render the template for ``gateways``, start ``nginx -g 'daemon off;'`` and wait for its port."""
    port = free_port_block(1)
    access_log = prefix / "access.log"
    servers = "\n    ".join(f"server 127.0.0.1:{g.port} max_fails=3 fail_timeout=5s;" for g in gateways)
    snippet = string.Template(TEMPLATE.read_text()).safe_substitute(
        PDSERVE_LISTEN=f"127.0.0.1:{port}", PDSERVE_UPSTREAM_SERVERS=servers, PDSERVE_ACCESS_LOG=access_log
    )
    (prefix / "pdserve.conf").write_text(snippet)
    # A root master would run its workers as "nobody", which cannot enter the test's 0700 tmp dir.
    user = "user root;" if os.geteuid() == 0 else ""
    (prefix / "nginx.conf").write_text(MAIN_CONF.format(prefix=prefix, user=user))
    cmd = [nginx_binary(), "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-g", "daemon off;"]
    check = subprocess.run([*cmd[:-2], "-t"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    with open(prefix / "error.log", "a") as log:  # what nginx says before it reads its config
        # Its own session: the master and its workers can be killed together as one process group.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    nginx = Nginx(proc, port, access_log)
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{nginx.base_url}/health", timeout=2).status_code == 200:
                return nginx
        time.sleep(0.1)
    stop_nginx(nginx)
    raise RuntimeError(f"nginx did not come up:\n{(prefix / 'error.log').read_text()[-4000:]}")


def stop_nginx(nginx: Nginx) -> None:
    """SIGQUIT (graceful: lets open requests finish), then SIGKILL to its process group after 10 s."""
    if nginx.proc.poll() is None:
        nginx.proc.send_signal(signal.SIGQUIT)
        try:
            nginx.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(nginx.proc.pid, signal.SIGKILL)
            nginx.proc.wait()


@pytest.fixture(scope="module")
def gateways(two_decode_stack: Stack, cache_aware_gateway: Stack) -> list[Stack]:
    return [two_decode_stack, cache_aware_gateway]


@pytest.fixture(scope="module")
def nginx(gateways: list[Stack], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    server = start_nginx(tmp_path_factory.mktemp("nginx"), gateways)
    yield server
    stop_nginx(server)


def chat_served(gateway: Stack) -> float:
    """Chat completions answered 200 by this replica (its own ``pdserve:gateway_requests`` counter)."""
    text = httpx.get(f"{gateway.base_url}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "pdserve:gateway_requests_total"
        and s.labels.get("role") == "gateway"
        and s.labels.get("endpoint") == "/v1/chat/completions"
        and s.labels.get("status") == "200"
    )


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)


def messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def ask(base_url: str, question: str) -> str:
    resp = client(base_url).chat.completions.create(
        model=MODEL, messages=messages(question), temperature=0, max_tokens=MAX_TOKENS
    )
    return resp.choices[0].message.content


@pytest.fixture(scope="module")
def expected(gateways: list[Stack]) -> dict[str, str]:
    """Greedy answer to each question from the launcher's gateway directly (no nginx); the first one
    also from the HF transformers reference (decoded like the server, special tokens skipped)."""
    answers = {q: ask(gateways[0].base_url, q) for q in QUESTIONS}
    reference = hf_greedy(chat_ids(messages(QUESTIONS[0])), MAX_TOKENS)
    assert answers[QUESTIONS[0]] == hf_tokenizer().decode(reference, skip_special_tokens=True)
    return answers


def test_chat_through_nginx_reaches_both_gateways(
    nginx: Nginx, gateways: list[Stack], expected: dict[str, str], two_decode
) -> None:
    before = [chat_served(g) for g in gateways]
    lb = client(nginx.base_url)
    rids = [f"lb-chat-{uuid.uuid4().hex}" for _ in QUESTIONS]
    for q, rid in zip(QUESTIONS, rids, strict=True):
        resp = lb.chat.completions.create(
            model=MODEL,
            messages=messages(q),
            temperature=0,
            max_tokens=MAX_TOKENS,
            extra_headers={"X-Request-Id": rid},
        )
        assert resp.choices[0].message.content == expected[q]
        assert resp.usage.prompt_tokens == len(chat_ids(messages(q)))
    served = [chat_served(g) - b for g, b in zip(gateways, before, strict=True)]
    assert sum(served) == len(QUESTIONS) and all(n > 0 for n in served), served
    upstreams = nginx.upstreams(rids)
    assert set(upstreams.values()) == {f"127.0.0.1:{g.port}" for g in gateways}, upstreams


def test_streaming_through_nginx_reaches_both_gateways(
    nginx: Nginx, gateways: list[Stack], expected: dict[str, str], two_decode
) -> None:
    before = [chat_served(g) for g in gateways]
    lb = client(nginx.base_url)
    for q in QUESTIONS:
        stream = lb.chat.completions.create(
            model=MODEL, messages=messages(q), temperature=0, max_tokens=MAX_TOKENS, stream=True
        )
        arrivals, chunks = [], []
        for chunk in stream:
            arrivals.append(time.monotonic())
            chunks.append(chunk)
        choices = [c.choices[0] for c in chunks]
        assert choices[0].delta.role == "assistant"
        assert all(c.delta.role is None for c in choices[1:])
        assert choices[-1].finish_reason in ("stop", "length")
        assert all(c.finish_reason is None for c in choices[:-1])
        assert "".join(c.delta.content or "" for c in choices) == expected[q]
        # Unbuffered: the chunks come as the tokens are made, not all at once at the end.
        assert len(chunks) > 2 and arrivals[-1] - arrivals[0] > 0.05, arrivals
    served = [chat_served(g) - b for g, b in zip(gateways, before, strict=True)]
    assert sum(served) == len(QUESTIONS) and all(n > 0 for n in served), served


def test_request_id_passes_through_nginx(nginx: Nginx, two_decode) -> None:
    lb = client(nginx.base_url)
    kwargs = {"model": MODEL, "messages": messages(QUESTIONS[0]), "temperature": 0, "max_tokens": 2}
    given = f"lb-rid-{uuid.uuid4().hex}"
    raw = lb.chat.completions.with_raw_response.create(**kwargs, extra_headers={"X-Request-Id": given})
    assert raw.headers["x-request-id"] == given
    assert raw.parse().id == f"chatcmpl-{given}"
    # Without one, nginx makes up an id (logged as rid=...), and the gateway uses it as the rid.
    raw = lb.chat.completions.with_raw_response.create(**kwargs)
    made_up = raw.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made_up), made_up
    assert raw.parse().id == f"chatcmpl-{made_up}"
    assert all(nginx.upstreams([given, made_up]).values())
