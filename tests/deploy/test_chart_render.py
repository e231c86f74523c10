"""The chart renders valid Kubernetes objects (checked against the API's OpenAPI schemas) and lints clean."""

from __future__ import annotations

import copy

import helm_python as helm
import kubernetes_validate
import pytest

from tests.deploy.conftest import CHART_DIR, NAMESPACE, RELEASE, Rendered, load_values, render

# The chart's kubeVersion floor (gRPC container probes went GA in 1.27) and the newest API known.
KUBE_VERSIONS = ("1.27", kubernetes_validate.utils.latest_version())

# Options that both values files leave off, switched on so that their templates are validated too.
OPTION_SETS = {
    "gpu-pd, servicemonitor, model on a PVC, existing API key Secret, cache on hostPath": (
        "gpu-pd",
        {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
            "model": {"name": "/models/llama", "source": {"type": "pvc", "pvc": {"claimName": "models"}}},
            "apiKey": {"existingSecret": "llm-keys", "secretKey": "openai"},
            "cache": {"type": "hostPath"},
            "kvTransfer": {"rdma": {"hostIPC": True}, "ucxNetDevices": "mlx5_0:1"},
        },
    ),
    "default, model from an init container, existing cache PVC, autoscaling, network policies": (
        "default",
        {
            "model": {
                "name": "/models/smollm2",
                "servedModelName": "smollm2",
                "source": {
                    "type": "initContainer",
                    "initContainer": {
                        "image": "busybox:1.36",
                        "command": ["sh", "-c", "cp -r /src/* $MODEL_DIR"],
                    },
                },
            },
            "cache": {"type": "pvc", "pvc": {"existingClaim": "pdserve-cache"}},
            "gateway": {"autoscaling": {"enabled": True}},
            "networkPolicy": {"enabled": True},
            "engine": {"maxTotalTokens": 65536, "kvCacheMemory": 40_000_000_000, "disableRadixCache": True},
            "apiKey": {"create": False},
        },
    ),
    "gpu-pd, TLS everywhere with its own public certificate and client certificates, network policies": (
        "gpu-pd",
        {
            "tls": {
                "enabled": True,
                "secretName": "pdserve-mtls",
                "publicSecretName": "pdserve-public-tls",
                "publicClientAuth": True,
            },
            "networkPolicy": {"enabled": True},
        },
    ),
}


@pytest.fixture(scope="module", params=sorted(OPTION_SETS))
def optional(request: pytest.FixtureRequest) -> Rendered:
    variant, overrides = OPTION_SETS[request.param]
    return render(load_values(variant, overrides))


def validate_all(chart: Rendered, version: str) -> int:
    """Validate every built-in object strictly (unknown fields fail); returns how many were checked."""
    checked = 0
    for obj in chart.objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema in the Kubernetes API (its wiring is checked in test_chart_wiring)
        kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    return checked


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_object_matches_the_kubernetes_api(rendered: Rendered, version: str) -> None:
    assert validate_all(rendered, version) == len(rendered.objects)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_optional_features_render_valid_objects(optional: Rendered, version: str) -> None:
    assert validate_all(optional, version) >= len(optional.objects) - 1


def test_the_validator_rejects_a_broken_object(default_chart: Rendered) -> None:
    deployment = copy.deepcopy(default_chart.workload("tokenizer"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[0], strict=True)


@pytest.mark.parametrize("variant", ["default", "gpu-pd"])
def test_helm_lint_is_clean(variant: str) -> None:
    report = helm.lint(
        CHART_DIR,
        load_values(variant),
        strict=True,
        namespace=NAMESPACE,
        kube_version=f"v{KUBE_VERSIONS[0]}.0",
    )
    assert report["errors"] == []
    # Only informational notes (e.g. "icon is recommended") remain.
    assert {m["severity"] for m in report["messages"]} <= {1}, report["messages"]


def replicas_by_name(objects: dict[str, dict]) -> dict[str, int | None]:
    return {name: obj["spec"].get("replicas") for name, obj in objects.items()}


def test_default_values_are_a_colocated_cpu_demo(default_chart: Rendered) -> None:
    prefix = f"{RELEASE}-pdserve-"
    assert replicas_by_name(default_chart.kind("Deployment")) == {
        f"{prefix}gateway": 1,
        f"{prefix}tokenizer": 1,
        f"{prefix}detokenizer": 1,
    }
    assert replicas_by_name(default_chart.kind("StatefulSet")) == {f"{prefix}decode": 1}
    assert not [obj for obj in default_chart.objects if "prefill" in obj["metadata"]["name"]]
    assert default_chart.env("decode")["PDSERVE_COLOCATED"] == "true"
    assert default_chart.env("gateway")["PDSERVE_PREFILL_ADDRESSES"] == ""
    assert default_chart.container("decode")["image"] == "pdserve:0.1.0"
    for component in ("gateway", "tokenizer", "detokenizer", "decode"):
        assert "nvidia.com/gpu" not in default_chart.container(component)["resources"]["limits"]
    assert not default_chart.kind("HorizontalPodAutoscaler")
    assert not default_chart.kind("NetworkPolicy")


def test_gpu_values_are_a_pd_deployment_over_rdma(gpu_chart: Rendered) -> None:
    prefix = f"{RELEASE}-pdserve-"
    assert replicas_by_name(gpu_chart.kind("StatefulSet")) == {f"{prefix}prefill": 2, f"{prefix}decode": 4}
    # Autoscaled Deployments leave replicas to their HorizontalPodAutoscaler.
    assert set(replicas_by_name(gpu_chart.kind("Deployment")).values()) == {None}
    assert sorted(gpu_chart.kind("HorizontalPodAutoscaler")) == sorted(gpu_chart.kind("Deployment"))
    for component in ("prefill", "decode"):
        container = gpu_chart.container(component)
        env = gpu_chart.env(component)
        assert container["image"] == "pdserve:0.1.0-cuda"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["resources"]["limits"]["rdma/hca_shared_devices_a"] == 1
        assert container["securityContext"]["capabilities"] == {"add": ["IPC_LOCK"], "drop": ["ALL"]}
        assert (env["PDSERVE_DTYPE"], env["PDSERVE_ATTENTION_BACKEND"]) == ("bfloat16", "flashinfer")
        assert env["UCX_TLS"].startswith("rc")
        assert "PDSERVE_COLOCATED" not in env
    assert gpu_chart.env("gateway")["PDSERVE_ROUTER_POLICY"] == "kv_aware"
    assert gpu_chart.kind("Service")[f"{prefix}gateway"]["spec"]["type"] == "LoadBalancer"
    assert len(gpu_chart.kind("NetworkPolicy")) == 5
