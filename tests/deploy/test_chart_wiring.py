"""The rendered objects fit together: selectors, ports, probes, addresses, references, security."""

from __future__ import annotations

import base64
import re
from typing import Any

import pytest

from pdserve.v1 import output_pb2, scheduler_pb2, tokenizer_pb2
from tests.deploy.conftest import CHART_DIR, NAMESPACE, RELEASE, Rendered, load_values, render

SCHEDULERS = ("prefill", "decode")
GRPC_SERVICES = {
    "tokenizer": tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name,
    "detokenizer": output_pb2.DESCRIPTOR.services_by_name["Detokenizer"].full_name,
    "prefill": scheduler_pb2.DESCRIPTOR.services_by_name["PrefillScheduler"].full_name,
    "decode": scheduler_pb2.DESCRIPTOR.services_by_name["DecodeScheduler"].full_name,
}


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def selected_workloads(chart: Rendered, selector: dict[str, str]) -> list[str]:
    return [name for name, w in chart.workloads().items() if selects(selector, pod_labels(w))]


def container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def service_of(chart: Rendered, component: str) -> dict[str, Any]:
    return chart.kind("Service")[f"{RELEASE}-pdserve-{component}"]


def test_every_service_selects_one_workload_and_its_ports(rendered: Rendered) -> None:
    for name, service in rendered.kind("Service").items():
        targets = selected_workloads(rendered, service["spec"]["selector"])
        assert targets == [name], f"Service {name} selects {targets}"
        ports = container_ports(rendered.workloads()[name]["spec"]["template"]["spec"]["containers"][0])
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"{name}: {port}"
            assert port["port"] == ports[port["targetPort"]]


def test_workload_selectors_match_their_own_pods(rendered: Rendered) -> None:
    for name, workload in rendered.workloads().items():
        assert selected_workloads(rendered, workload["spec"]["selector"]["matchLabels"]) == [name]


def test_every_probe_targets_a_declared_container_port(rendered: Rendered) -> None:
    for name, workload in rendered.workloads().items():
        container = pod_spec(workload)["containers"][0]
        ports = container_ports(container)
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container[kind]
            if "grpc" in probe:
                assert probe["grpc"]["port"] in ports.values(), f"{name} {kind}"
            else:
                assert probe["httpGet"]["port"] in ports, f"{name} {kind}"


def test_readiness_asks_health_for_the_service_each_role_registers(rendered: Rendered) -> None:
    for component, service_name in GRPC_SERVICES.items():
        if f"{RELEASE}-pdserve-{component}" not in rendered.workloads():
            continue  # prefill with 0 replicas is not deployed
        probes = rendered.container(component)
        assert probes["readinessProbe"]["grpc"]["service"] == service_name
        assert "service" not in probes["livenessProbe"]["grpc"]  # "" = the server as a whole
    gateway = rendered.container("gateway")
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert gateway["livenessProbe"]["grpc"]["port"] == container_ports(gateway)["grpc"]


def test_every_role_listens_on_its_declared_port(rendered: Rendered) -> None:
    for name, workload in rendered.workloads().items():
        component = name.removeprefix(f"{RELEASE}-pdserve-")
        container = pod_spec(workload)["containers"][0]
        env = rendered.env(component)
        ports = container_ports(container)
        assert container["args"][0] == component
        assert env["PDSERVE_HOST"] == "0.0.0.0"
        if component == "gateway":
            assert (int(env["PDSERVE_PORT"]), int(env["PDSERVE_GRPC_PORT"])) == (ports["http"], ports["grpc"])
        else:
            assert int(env["PDSERVE_PORT"]) == ports["grpc"]


def test_gateway_addresses_are_the_schedulers_pod_dns_names(rendered: Rendered) -> None:
    """decode/prefill: one <pod>.<headless service>.<ns>.svc address per StatefulSet replica."""
    env = rendered.env("gateway")
    for component in SCHEDULERS:
        addresses = [a for a in env[f"PDSERVE_{component.upper()}_ADDRESSES"].split(",") if a]
        replicas = rendered.values.get(component, {}).get("replicas", 1 if component == "decode" else 0)
        assert len(addresses) == replicas
        if not replicas:
            continue
        statefulset = rendered.workload(component)
        headless = rendered.kind("Service")[statefulset["spec"]["serviceName"]]
        assert headless["spec"]["clusterIP"] == "None"
        assert headless["spec"]["publishNotReadyAddresses"] is True
        assert selects(headless["spec"]["selector"], pod_labels(statefulset))
        port = headless["spec"]["ports"][0]["port"]
        pods = [f"{statefulset['metadata']['name']}-{i}" for i in range(statefulset["spec"]["replicas"])]
        suffix = f"{headless['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
        assert addresses == [f"{pod}.{suffix}:{port}" for pod in pods]
        # Each scheduler advertises (to detokenizers and peers) the same name the gateway dials.
        advertise = rendered.env(component)["PDSERVE_ADVERTISE_HOST"]
        assert [advertise.replace("$(POD_NAME)", pod) + f":{port}" for pod in pods] == addresses


def test_gateway_reaches_stateless_roles_through_their_headless_services(rendered: Rendered) -> None:
    env = rendered.env("gateway")
    for component in ("tokenizer", "detokenizer"):
        service = service_of(rendered, component)
        assert service["spec"]["clusterIP"] == "None"
        assert "publishNotReadyAddresses" not in service["spec"]  # only ready pods resolve
        port = service["spec"]["ports"][0]["port"]
        # a dns:/// target: gRPC resolves every ready pod and round-robins calls over them
        expected = f"dns:///{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{port}"
        assert env[f"PDSERVE_{component.upper()}_ADDRESSES"] == expected
    # Detokenizers stream text back to the gateway pod that owns the request, on its gRPC port.
    assert env["PDSERVE_ADVERTISE_HOST"] == "$(POD_IP)"
    assert [
        e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in rendered.container("gateway")["env"]
        if e["name"] == "POD_IP"
    ] == ["status.podIP"]


def test_env_references_resolve(rendered: Rendered) -> None:
    """Every $(VAR) is defined earlier in the list; every ConfigMap and chart-made Secret exists."""
    secrets = rendered.kind("Secret")
    for name, workload in rendered.workloads().items():
        container = pod_spec(workload)["containers"][0]
        defined: set[str] = set()
        for entry in container["env"]:
            for ref in re.findall(r"\$\((\w+)\)", entry.get("value", "")):
                assert ref in defined, f"{name}: {entry['name']} uses $({ref}) before it is defined"
            if secret_ref := entry.get("valueFrom", {}).get("secretKeyRef"):
                assert secret_ref["key"] in secrets[secret_ref["name"]]["data"]
            defined.add(entry["name"])
        for source in container["envFrom"]:
            assert source["configMapRef"]["name"] in rendered.kind("ConfigMap")


def test_api_key_secret_reaches_gateway_and_helm_test_only(rendered: Rendered) -> None:
    (secret_name,) = rendered.kind("Secret")
    key = base64.b64decode(rendered.kind("Secret")[secret_name]["data"]["api-key"]).decode()
    assert len(key) == 40 and key.isalnum()
    users = {
        name
        for name, obj in {**rendered.workloads(), **rendered.kind("Pod")}.items()
        for container in (obj["spec"].get("template", obj)["spec"]["containers"])
        for entry in container.get("env", [])
        if entry.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == secret_name
    }
    assert users == {f"{RELEASE}-pdserve-gateway", f"{RELEASE}-pdserve-test-chat"}


def test_autoscalers_and_disruption_budgets_target_real_workloads(rendered: Rendered) -> None:
    for hpa in rendered.kind("HorizontalPodAutoscaler").values():
        target = hpa["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and target["name"] in rendered.kind("Deployment")
        assert "replicas" not in rendered.kind("Deployment")[target["name"]]["spec"]
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    budgets = rendered.kind("PodDisruptionBudget")
    assert sorted(budgets) == sorted(rendered.workloads())
    for name, pdb in budgets.items():
        assert selected_workloads(rendered, pdb["spec"]["selector"]["matchLabels"]) == [name]


def network_policy_peers(chart: Rendered) -> dict[str, set[tuple[str, str]]]:
    """component -> {(peer component or "anyone", container port name or "all")} its policy lets in."""
    allowed: dict[str, set[tuple[str, str]]] = {}
    for policy in chart.kind("NetworkPolicy").values():
        (target,) = selected_workloads(chart, policy["spec"]["podSelector"]["matchLabels"])
        names = {
            n: name
            for name, n in container_ports(pod_spec(chart.workloads()[target])["containers"][0]).items()
        }
        for rule in policy["spec"]["ingress"]:
            peers = [
                w.rsplit("-", 1)[1]
                for f in rule.get("from", [])
                for w in selected_workloads(chart, f["podSelector"]["matchLabels"])
            ]
            ports = [names[p["port"]] for p in rule.get("ports", [])] or ["all"]
            allowed.setdefault(target.rsplit("-", 1)[1], set()).update(
                (peer, port) for peer in peers or ["anyone"] for port in ports
            )
    return allowed


def test_network_policies_let_only_the_intended_peers_in(gpu_chart: Rendered) -> None:
    """The gateway's internal port (GatewayOutput) is open to the detokenizers only; its public ports
    to anyone; every other role's port to its callers only; every pod's metrics port to Prometheus."""
    scrape = ("anyone", "metrics")
    assert network_policy_peers(gpu_chart) == {
        "gateway": {("anyone", "http"), ("anyone", "grpc"), ("detokenizer", "internal"), scrape},
        "tokenizer": {("gateway", "grpc"), scrape},
        "detokenizer": {("gateway", "grpc"), ("decode", "grpc"), scrape},
        "prefill": {("gateway", "grpc"), ("decode", "all"), scrape},
        "decode": {("gateway", "grpc"), ("detokenizer", "grpc"), ("prefill", "all"), scrape},
    }


def test_pods_run_non_root_on_a_read_only_root_with_writable_tmp_and_cache(rendered: Rendered) -> None:
    rdma = rendered.values.get("kvTransfer", {}).get("rdma", {}).get("enabled", False)
    pods = {name: pod_spec(w) for name, w in rendered.workloads().items()}
    pods.update({name: pod["spec"] for name, pod in rendered.kind("Pod").items()})
    for name, spec in pods.items():
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        assert spec["automountServiceAccountToken"] is False
        volumes = {v["name"]: v for v in spec["volumes"]}
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
            scheduler = name.rsplit("-", 1)[1] in SCHEDULERS
            assert context["capabilities"].get("add", []) == (["IPC_LOCK"] if rdma and scheduler else [])
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            assert {m["name"] for m in mounts.values()} <= set(volumes)
            assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
            if name in rendered.workloads():
                cache = mounts[rendered.env(name.rsplit("-", 1)[1])["PDSERVE_CACHE_DIR"]]
                assert not cache.get("readOnly", False)


def test_schedulers_get_shared_memory_and_rdma_only_where_asked(rendered: Rendered) -> None:
    kv = rendered.values.get("kvTransfer", {})
    for component in SCHEDULERS:
        if f"{RELEASE}-pdserve-{component}" not in rendered.workloads():
            continue
        spec = pod_spec(rendered.workload(component))
        shm = {v["name"]: v for v in spec["volumes"]}["shm"]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}["shm"] == "/dev/shm"
        limits = spec["containers"][0]["resources"]["limits"]
        assert ("rdma/hca_shared_devices_a" in limits) == kv.get("rdma", {}).get("enabled", False)
    for component in ("gateway", "tokenizer", "detokenizer"):
        spec = pod_spec(rendered.workload(component))
        assert "shm" not in {v["name"] for v in spec["volumes"]} and "hostIPC" not in spec


def test_tensor_parallel_schedulers_ask_a_gpu_per_rank() -> None:
    chart = render(load_values("gpu-pd", {"engine": {"tpSize": 2}}))
    for component in SCHEDULERS:
        assert chart.env(component)["PDSERVE_TP_SIZE"] == "2"
        resources = pod_spec(chart.workload(component))["containers"][0]["resources"]
        per_rank = chart.values[component]["gpus"]
        assert (
            resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 2 * per_rank
        )


def test_prefill_and_decode_may_have_their_own_tp_sizes() -> None:
    chart = render(load_values("gpu-pd", {"engine": {"tpSize": 1}, "prefill": {"tpSize": 2}}))
    for component, tp in (("prefill", 2), ("decode", 1)):
        assert chart.env(component)["PDSERVE_TP_SIZE"] == str(tp)
        resources = pod_spec(chart.workload(component))["containers"][0]["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == tp * chart.values[component]["gpus"]


def test_config_changes_roll_the_pods(default_chart: Rendered) -> None:
    changed = render(load_values("default", {"engine": {"dtype": "float32"}}))

    def checksum(chart: Rendered) -> str:
        return chart.workload("decode")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    assert changed.env("decode")["PDSERVE_DTYPE"] == "float32"
    assert checksum(changed) != checksum(default_chart)


def test_service_monitor_scrapes_the_gateway_metrics() -> None:
    chart = render(load_values("default", {"serviceMonitor": {"enabled": True}}))
    (monitor,) = chart.kind("ServiceMonitor").values()
    gateway = service_of(chart, "gateway")
    assert selects(monitor["spec"]["selector"]["matchLabels"], gateway["metadata"]["labels"])
    assert not selects(
        monitor["spec"]["selector"]["matchLabels"], service_of(chart, "decode")["metadata"]["labels"]
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (
        endpoint["port"] in {p["name"] for p in gateway["spec"]["ports"]} and endpoint["path"] == "/metrics"
    )
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]


@pytest.mark.parametrize("variant", ["default", "gpu-pd"])
def test_helm_test_pod_runs_the_chat_check_against_the_gateway(variant: str) -> None:
    chart = render(load_values(variant))
    (pod,) = chart.kind("Pod").values()
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = pod["spec"]["containers"][0]
    assert container["command"][:2] == ["python", "-c"]
    assert container["command"][2] == (CHART_DIR / "files" / "chat_smoke_test.py").read_text()
    env = {e["name"]: e.get("value") for e in container["env"]}
    gateway = service_of(chart, "gateway")
    http = {p["name"]: p["port"] for p in gateway["spec"]["ports"]}["http"]
    assert env["PDSERVE_TEST_URL"] == f"http://{gateway['metadata']['name']}:{http}"
    assert container["image"] == chart.container("gateway")["image"]


def test_tls_mounts_one_secret_everywhere_and_probes_the_plaintext_health_port() -> None:
    """tls.enabled: every role reads the same mounted Secret through PDSERVE_TLS_*; the kubelet's
    gRPC probes (which speak no TLS) go to the health-only port; the gateway's public listeners take
    their own Secret and ask the public gRPC API for client certificates; `helm test` speaks HTTPS."""
    tls = {"enabled": True, "secretName": "mtls", "publicSecretName": "public", "publicClientAuth": True}
    chart = render(load_values("gpu-pd", {"tls": tls}))
    mount = "/etc/pdserve/tls"
    for component in ("gateway", "tokenizer", "detokenizer", "prefill", "decode"):
        env = chart.env(component)
        assert {k: v for k, v in env.items() if k.startswith("PDSERVE_TLS_")} == {
            "PDSERVE_TLS_CERT": f"{mount}/tls.crt",
            "PDSERVE_TLS_KEY": f"{mount}/tls.key",
            "PDSERVE_TLS_CA": f"{mount}/ca.crt",
            "PDSERVE_TLS_SERVER_NAME": "pdserve.internal",
        }
        assert env["PDSERVE_HEALTH_PORT"] == "8086"
        container = chart.container(component)
        spec = pod_spec(chart.workload(component))
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "mtls"
        assert {"name": "tls", "mountPath": mount, "readOnly": True} in container["volumeMounts"]
        assert container_ports(container)["health"] == 8086
        for probe in ("startupProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == 8086, (component, probe)
        if component != "gateway":
            assert container["readinessProbe"]["grpc"]["port"] == 8086
    gateway = chart.env("gateway")
    assert gateway["PDSERVE_PUBLIC_TLS_CERT"] == "/etc/pdserve/public-tls/tls.crt"
    assert gateway["PDSERVE_PUBLIC_CLIENT_CA"] == f"{mount}/ca.crt"
    assert chart.container("gateway")["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert "public-tls" not in {v["name"] for v in pod_spec(chart.workload("decode"))["volumes"]}
    (test_pod,) = chart.kind("Pod").values()
    test_env = {e["name"]: e.get("value") for e in test_pod["spec"]["containers"][0]["env"]}
    assert test_env["PDSERVE_TEST_URL"].startswith("https://")
    assert test_env["PDSERVE_TEST_CA"] == f"{mount}/ca.crt"


def test_the_gateway_service_exposes_only_the_public_ports(rendered: Rendered) -> None:
    gateway = service_of(rendered, "gateway")
    assert [p["targetPort"] for p in gateway["spec"]["ports"]] == ["http", "grpc"]
    env = rendered.env("gateway")
    internal = container_ports(rendered.container("gateway"))["internal"]
    assert (env["PDSERVE_INTERNAL_HOST"], env["PDSERVE_INTERNAL_GRPC_PORT"]) == ("0.0.0.0", str(internal))
    assert "PDSERVE_TLS_CERT" not in env  # TLS is off unless asked for


def test_gateway_workers_share_the_pod_ports() -> None:
    """``gateway.workers: 3`` runs three gateway processes per pod (the gateway's ``--workers``), and
    the NetworkPolicy lets the detokenizers reach each one's internal port (internalPort + i)."""
    chart = render(load_values("default", {"gateway": {"workers": 3}, "networkPolicy": {"enabled": True}}))
    assert chart.env("gateway")["PDSERVE_WORKERS"] == "3"
    internal = int(chart.env("gateway")["PDSERVE_INTERNAL_GRPC_PORT"])
    (policy,) = [p for name, p in chart.kind("NetworkPolicy").items() if name.endswith("-gateway")]
    ingress = [port for rule in policy["spec"]["ingress"] for port in rule["ports"]]
    assert {"port": internal, "endPort": internal + 2, "protocol": "TCP"} in ingress
    assert "PDSERVE_WORKERS" not in render(load_values("default")).env("gateway")
