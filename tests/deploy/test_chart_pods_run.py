"""Run the real services with exactly the environment the chart gives their pods, then `helm test`'s script.

Kubernetes cannot run here, so each role of the default (colocated) values starts as the container
would — ``pdserve <args>`` with the pod's env (ConfigMaps, plain values, the API key Secret) — on
loopback: cluster DNS names become 127.0.0.1 and $(POD_IP)/$(POD_NAME) get local values. The probes
are then asked what the kubelet would ask.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve.model_source import cache_dir
from tests.deploy.conftest import Rendered, load_values, render
from tests.stack import free_port_block

ROLES = ("tokenizer", "detokenizer", "decode", "gateway")
API_KEY = "pod-test-key"


def metrics_port(base: int, role: str) -> int:
    return base + 6 + ROLES.index(role)


@dataclass
class Pods:
    chart: Rendered
    procs: dict[str, subprocess.Popen]
    logs: Path
    base: int  # the first of the ports the roles were given here

    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.chart.values['gateway']['port']}"

    def log_tail(self, role: str) -> str:
        return (self.logs / f"{role}.log").read_text()[-4000:]


def pod_env(chart: Rendered, role: str, home: Path, metrics_port: int) -> dict[str, str]:
    """The container's environment as the kubelet builds it, mapped onto this machine (every pod's
    metrics port, one number in the chart, is ``metrics_port`` here)."""
    (secret,) = chart.kind("Secret").values()
    env = {**os.environ, **chart.env(role)}
    for entry in chart.container(role)["env"]:
        if key_ref := entry.get("valueFrom", {}).get("secretKeyRef"):
            env[entry["name"]] = base64.b64decode(secret["data"][key_ref["key"]]).decode()
    ports = {r: chart.values[r]["port"] for r in ROLES}
    for name, value in list(env.items()):
        if name.startswith("PDSERVE_") and name.endswith("_ADDRESSES") and value:
            peer = name.removeprefix("PDSERVE_").removesuffix("_ADDRESSES").lower()
            assert len(value.split(",")) == 1
            env[name] = f"127.0.0.1:{ports[peer]}"
    if "PDSERVE_ADVERTISE_HOST" in env:
        env["PDSERVE_ADVERTISE_HOST"] = "127.0.0.1"
    assert env["PDSERVE_METRICS_PORT"] == str(container_port(chart, role, "metrics"))
    env["PDSERVE_METRICS_PORT"] = str(metrics_port)
    env["PDSERVE_WORKER_ID"] = env.get("PDSERVE_WORKER_ID", "").replace("$(POD_NAME)", f"{role}-0")
    # The chart's cache and home are pod volumes; here they are this machine's model cache and a tmp dir.
    env["PDSERVE_CACHE_DIR"] = str(cache_dir())
    env["HOME"] = str(home)
    return env


def container_port(chart: Rendered, role: str, name: str) -> int:
    (port,) = [p["containerPort"] for p in chart.container(role)["ports"] if p["name"] == name]
    return port


def health(port: int, service: str = "") -> str:
    """grpc.health.v1 Check as a kubelet gRPC probe sends it: the status name, or the error code."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            request = health_pb2.HealthCheckRequest(service=service)
            status = health_pb2_grpc.HealthStub(channel).Check(request, timeout=2).status
            return health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        except grpc.RpcError as error:
            return error.code().name


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pods]:
    base = free_port_block(6 + len(ROLES))  # the roles' ports, then each one's metrics port
    overrides = {role: {"port": base + i} for i, role in enumerate(ROLES)}
    overrides["gateway"].update(grpcPort=base + len(ROLES), internalPort=base + len(ROLES) + 1)
    overrides["apiKey"] = {"value": API_KEY}
    chart = render(load_values("default", overrides))
    logs = tmp_path_factory.mktemp("pods")
    procs: dict[str, subprocess.Popen] = {}
    for role in ROLES:
        with open(logs / f"{role}.log", "w") as log:
            procs[role] = subprocess.Popen(
                [sys.executable, "-m", "pdserve.cli", *chart.container(role)["args"]],
                env=pod_env(chart, role, logs, metrics_port(base, role)),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    running = Pods(chart, procs, logs, base)
    try:
        deadline = time.monotonic() + 300
        while True:
            for role, proc in procs.items():
                assert proc.poll() is None, f"{role} exited:\n{running.log_tail(role)}"
            try:
                if httpx.get(f"{running.gateway_url()}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "\n".join(running.log_tail(r) for r in ROLES)
            time.sleep(0.5)
        yield running
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_probes_see_every_role_ready_and_alive(pods: Pods) -> None:
    for role in ("tokenizer", "detokenizer", "decode"):
        container = pods.chart.container(role)
        readiness = container["readinessProbe"]["grpc"]
        assert health(readiness["port"], readiness["service"]) == "SERVING", role
        assert health(container["livenessProbe"]["grpc"]["port"]) == "SERVING", role
        # A name the server never registers stays unknown: readiness really asks for the role's service.
        assert health(readiness["port"], "pdserve.v1.NoSuchService") == "NOT_FOUND", role
    gateway = pods.chart.container("gateway")
    assert health(gateway["livenessProbe"]["grpc"]["port"]) == "SERVING"
    ready = httpx.get(f"{pods.gateway_url()}{gateway['readinessProbe']['httpGet']['path']}", timeout=10)
    assert ready.status_code == 200
    assert set(ready.json()["roles"]) == {"tokenizer", "detokenizer", "decode"}


def test_every_pod_serves_its_own_metrics_with_the_model_name(pods: Pods) -> None:
    """What the PodMonitor scrapes: each role's /metrics on its metrics port."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    model = httpx.get(f"{pods.gateway_url()}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    for role in ROLES:
        port = metrics_port(pods.base, role)
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert "pdserve:rpc_requests" in families and "process_resident_memory_bytes" in families, role
        assert all(s.labels["model_name"] == model for f in families.values() for s in f.samples), role


def run_helm_test(pods: Pods, api_key: str) -> subprocess.CompletedProcess[str]:
    """The test Pod's command with its env (PATH's python is the image's, here this venv's)."""
    (pod,) = pods.chart.kind("Pod").values()
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env.update(
        PDSERVE_TEST_URL=pods.gateway_url(),  # the Service name resolves to the gateway pod
        PDSERVE_API_KEY=api_key,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    )
    return subprocess.run(container["command"], env=env, capture_output=True, text=True, timeout=300)


def test_helm_test_script_passes_and_reports_the_gateways_answer(pods: Pods) -> None:
    result = run_helm_test(pods, API_KEY)
    assert result.returncode == 0, result.stderr
    headers = {"Authorization": f"Bearer {API_KEY}"}
    model = httpx.get(f"{pods.gateway_url()}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": pods.chart.values.get("tests", {}).get("maxTokens", 16),
        "temperature": 0,
    }
    answer = httpx.post(f"{pods.gateway_url()}/v1/chat/completions", json=body, headers=headers, timeout=120)
    text = answer.json()["choices"][0]["message"]["content"]
    assert any(ch.isalpha() for ch in text)
    assert result.stdout.strip() == f"{model} answered {text!r}"


def test_helm_test_script_fails_without_the_api_key(pods: Pods) -> None:
    result = run_helm_test(pods, "not-the-key")
    assert result.returncode != 0
    assert "401" in result.stderr
