"""Every PDSERVE_* variable the chart sets is a flag of its role's real command line, with equal choices."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.model_source import cache_dir
from tests.deploy.conftest import CHART_DIR, RELEASE, Rendered, load_values, render

ROLES = ("gateway", "tokenizer", "detokenizer", "prefill", "decode")
# Read by pdserve.model_source rather than parsed as a flag.
NOT_FLAGS = {"PDSERVE_CACHE_DIR"}


def help_flags(role: str) -> dict[str, list[str] | None]:
    """``pdserve ROLE --help`` (in this process) -> {"--flag": [choices] or None}."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        cli.main([role, "--help"])
    assert exit_info.value.code == 0
    return {
        flag: choices.split(",") if choices else None
        for flag, choices in re.findall(
            r"^\s+(?:-\w, )?(--[\w-]+)(?: \{([^}]*)\})?", out.getvalue(), re.MULTILINE
        )
    }


@pytest.fixture(scope="module")
def flags() -> dict[str, dict[str, list[str] | None]]:
    return {role: help_flags(role) for role in ROLES}


@pytest.fixture(scope="module", params=["default", "gpu-pd", "gpu-pd+options"])
def chart(request: pytest.FixtureRequest) -> Rendered:
    if request.param == "gpu-pd+options":
        overrides = {
            "model": {"name": "/models/m", "servedModelName": "m"},
            "engine": {
                "maxTotalTokens": 4096,
                "kvCacheMemory": 1 << 30,
                "kvTierMemory": 1 << 31,
                "disableRadixCache": True,
                "maxQueuedRequests": 0,
            },
            "prefill": {"maxRunningRequests": 8},
            "gateway": {"maxPendingRequests": 100},
        }
        return render(load_values("gpu-pd", overrides))
    return render(load_values(request.param))


def flag_of(variable: str) -> str:
    return "--" + variable.removeprefix("PDSERVE_").lower().replace("_", "-")


def test_every_pdserve_variable_is_a_flag_of_its_role(chart: Rendered, flags: dict) -> None:
    checked = 0
    for component in ROLES:
        if f"{RELEASE}-pdserve-{component}" not in chart.workloads():
            continue
        container = chart.container(component)
        variables = set(chart.env(component)) | {e["name"] for e in container["env"]}
        for variable in sorted(v for v in variables if v.startswith("PDSERVE_") and v not in NOT_FLAGS):
            assert flag_of(variable) in flags[component], (
                f"{component} has no {flag_of(variable)} for {variable}"
            )
            checked += 1
    assert checked >= 20


def test_cache_dir_variable_is_where_the_model_cache_goes(
    default_chart: Rendered, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = default_chart.env("decode")["PDSERVE_CACHE_DIR"]
    monkeypatch.setenv("PDSERVE_CACHE_DIR", path)
    assert cache_dir() == Path(path)


def test_schema_enums_are_the_flags_choices(flags: dict) -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    props = schema["properties"]
    policy = schema["definitions"]["schedulePolicy"]["enum"]
    pairs = [
        (props["engine"]["properties"]["dtype"]["enum"], "--dtype", ("prefill", "decode")),
        (
            props["engine"]["properties"]["attentionBackend"]["enum"],
            "--attention-backend",
            ("prefill", "decode"),
        ),
        (props["engine"]["properties"]["quantization"]["enum"], "--quantization", ("prefill", "decode")),
        (policy, "--schedule-policy", ("prefill", "decode")),
        (props["gateway"]["properties"]["routerPolicy"]["enum"], "--router-policy", ("gateway",)),
    ]
    for enum, flag, roles in pairs:
        for role in roles:
            assert flags[role][flag] == enum, f"{role} {flag}"
