"""Render the pdserve Helm chart with Helm's own engine (helm-python-sdk) into Kubernetes objects."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "deploy" / "helm" / "pdserve"
NAMESPACE = "serving"
RELEASE = "llm"
VALUES_FILES = {"default": None, "gpu-pd": CHART_DIR / "values-gpu-pd.yaml"}


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` over ``base`` as ``helm -f a.yaml -f b.yaml`` layers values files (maps merge)."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_values(variant: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """User values of ``variant`` (a key of VALUES_FILES) with ``overrides`` layered on top."""
    path = VALUES_FILES[variant]
    values = yaml.safe_load(path.read_text()) if path else {}
    return deep_merge(values, overrides or {})


@dataclass
class Rendered:
    """The objects one ``helm template`` produced, indexed by kind and name."""

    values: dict[str, Any]
    objects: list[dict[str, Any]]
    notes: str
    by_kind: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for obj in self.objects:
            self.by_kind.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj

    def kind(self, kind: str) -> dict[str, dict[str, Any]]:
        return self.by_kind.get(kind, {})

    def workloads(self) -> dict[str, dict[str, Any]]:
        """Deployments and StatefulSets by name."""
        return {**self.kind("Deployment"), **self.kind("StatefulSet")}

    def workload(self, component: str) -> dict[str, Any]:
        return self.workloads()[f"{RELEASE}-pdserve-{component}"]

    def container(self, component: str) -> dict[str, Any]:
        return self.workload(component)["spec"]["template"]["spec"]["containers"][0]

    def env(self, component: str) -> dict[str, str]:
        """The container's environment: its ConfigMaps (envFrom) overlaid by its own plain values."""
        container = self.container(component)
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            env.update(self.kind("ConfigMap")[source["configMapRef"]["name"]]["data"])
        env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
        return env


def render(values: dict[str, Any]) -> Rendered:
    """``helm template RELEASE CHART_DIR -n NAMESPACE`` with ``values``, hooks and tests included.

    Raises:
        helm_python.HelmValuesError: values.schema.json rejects ``values``.
        helm_python.HelmRenderError: a template fails (e.g. a ``fail`` in pdserve.validate).
    """
    with helm.Chart.load(CHART_DIR) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = [
        doc
        for path, text in sorted(manifests.items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]
    return Rendered(values, objects, manifests.get("pdserve/templates/NOTES.txt", ""))


@pytest.fixture(scope="session", params=sorted(VALUES_FILES))
def rendered(request: pytest.FixtureRequest) -> Iterator[Rendered]:
    """The chart rendered with values.yaml alone and with values-gpu-pd.yaml."""
    yield render(load_values(request.param))


@pytest.fixture(scope="session")
def default_chart() -> Rendered:
    return render(load_values("default"))


@pytest.fixture(scope="session")
def gpu_chart() -> Rendered:
    return render(load_values("gpu-pd"))
