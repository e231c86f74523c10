"""values.schema.json and the chart's own checks reject bad values inside Helm (template and lint)."""

from __future__ import annotations

import json
import re
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.deploy.conftest import CHART_DIR, NAMESPACE, load_values, render

# (values layered over values.yaml, the path Helm's schema error must name)
SCHEMA_VIOLATIONS = [
    ({"decode": {"replicas": -1}}, "/decode/replicas"),
    ({"prefill": {"replicas": -2}}, "/prefill/replicas"),
    ({"decode": {"replicas": 0}}, "/decode/replicas"),
    ({"tokenizer": {"replicas": 1.5}}, "/tokenizer/replicas"),
    ({"gateway": {"port": 70000}}, "/gateway/port"),
    ({"decode": {"port": 0}}, "/decode/port"),
    ({"engine": {"dtype": "float16"}}, "/engine/dtype"),
    ({"engine": {"attentionBackend": "triton"}}, "/engine/attentionBackend"),
    ({"engine": {"pageSize": "16"}}, "/engine/pageSize"),
    ({"engine": {"quantization": "fp4"}}, "/engine/quantization"),
    ({"gateway": {"routerPolicy": "random"}}, "/gateway/routerPolicy"),
    ({"decode": {"schedulePolicy": "lifo"}}, "/decode/schedulePolicy"),
    ({"image": {"variant": "rocm"}}, "/image/variant"),
    ({"cache": {"emptyDir": {"sizeLimit": "lots"}}}, "/cache/emptyDir/sizeLimit"),
    ({"decode": {"replicaCount": 2}}, "/decode"),
    ({"gateway": {"autoscaling": {"targetCPUUtilizationPercentage": 150}}}, "/gateway/autoscaling"),
    ({"gateway": {"internalPort": 0}}, "/gateway/internalPort"),
    ({"tls": {"enabled": "yes"}}, "/tls/enabled"),
    ({"tls": {"healthPort": 70000}}, "/tls/healthPort"),
    ({"tls": {"serverName": ""}}, "/tls/serverName"),
    ({"tls": {"cert": "/etc/tls.crt"}}, "/tls"),
    ({"decode": {"drainTimeoutSeconds": -1}}, "/decode/drainTimeoutSeconds"),
    ({"decode": {"autoscaling": {"kvUsageTarget": 1.5}}}, "/decode/autoscaling/kvUsageTarget"),
]

# Values each valid on its own that the chart refuses together (pdserve.validate).
TEMPLATE_FAILURES = [
    ({"engine": {"attentionBackend": "flashinfer"}}, "flashinfer runs on CUDA only"),
    (
        {"engine": {"quantization": "w8a8_int8"}, "decode": {"gpus": 1}, "image": {"variant": "cuda"}},
        "w8a8_int8 runs on CPU only",
    ),
    ({"decode": {"gpus": 1}}, "set image.variant=cuda"),
    ({"model": {"source": {"type": "pvc"}}}, "needs model.source.pvc.claimName"),
    ({"model": {"source": {"type": "initContainer"}}}, "needs model.source.initContainer.image"),
    ({"tls": {"enabled": True}}, "tls.enabled needs tls.secretName"),
    (
        {"prefill": {"replicas": 1, "drainTimeoutSeconds": 60, "terminationGracePeriodSeconds": 60}},
        "prefill.terminationGracePeriodSeconds must be at least prefill.drainTimeoutSeconds",
    ),
    ({"decode": {"autoscaling": {"enabled": True}}}, "decode.autoscaling reads the per-pod metrics"),
    (
        {"podMonitor": {"enabled": True}, "prefill": {"autoscaling": {"enabled": True}}},
        "prefill.autoscaling needs prefill.replicas > 0",
    ),
]


def lint_errors(values: dict[str, Any]) -> list[str]:
    return helm.lint(CHART_DIR, values, strict=True, namespace=NAMESPACE)["errors"]


@pytest.mark.parametrize(("overrides", "path"), SCHEMA_VIOLATIONS, ids=[p for _, p in SCHEMA_VIOLATIONS])
def test_helm_template_and_lint_reject_values_the_schema_forbids(
    overrides: dict[str, Any], path: str
) -> None:
    values = load_values("default", overrides)
    with pytest.raises(helm.HelmValuesError, match=f"at '{path}"):
        render(values)
    assert any(f"at '{path}" in error for error in lint_errors(values))


@pytest.mark.parametrize(("overrides", "message"), TEMPLATE_FAILURES, ids=[m for _, m in TEMPLATE_FAILURES])
def test_chart_refuses_inconsistent_values(overrides: dict[str, Any], message: str) -> None:
    """``helm template``/``install`` stop at the ``fail`` (``helm lint`` only logs it, by Helm's design)."""
    with pytest.raises(helm.HelmRenderError, match=message):
        render(load_values("default", overrides))


def test_shipped_values_files_satisfy_the_schema() -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        assert chart.schema == json.loads((CHART_DIR / "values.schema.json").read_text())
        for variant in ("default", "gpu-pd"):
            chart.validate_schema(chart.merge_values(load_values(variant)))


ROLES = ("gateway", "tokenizer", "detokenizer", "prefill", "decode")


def test_every_default_value_is_documented_in_the_readme() -> None:
    """Each key of values.yaml falls under a row of README.md's values tables.

    A row's first cell holds one or more `key`s; `<role>.key` stands for the key of all five roles.
    """

    def leaves(node: Any, prefix: str = "") -> list[str]:
        if isinstance(node, dict) and node:
            return [leaf for key, value in node.items() for leaf in leaves(value, f"{prefix}{key}.")]
        return [prefix.rstrip(".")]

    documented: set[str] = set()
    for line in (CHART_DIR / "README.md").read_text().splitlines():
        if line.startswith("| `"):
            for key in re.findall(r"`([^`]+)`", line.split("|")[1]):
                documented.update(key.replace("<role>", role) for role in ROLES)
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    missing = [
        key
        for key in leaves(defaults)
        if not any(key == row or key.startswith(row + ".") for row in documented)
    ]
    assert missing == []
