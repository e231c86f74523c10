"""The SDK alone: built from source into a fresh virtual environment (no torch, no pdserve) and used there."""

from __future__ import annotations

import json
import shutil
import subprocess
import venv
from pathlib import Path

from pdserve_sdk import Client

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import importlib.util, json, sys
from pdserve_sdk import Client
with Client(sys.argv[1]) as client:
    result = client.generate("The capital of France is", temperature=0, max_new_tokens=8)
heavy = [m for m in ("torch", "transformers", "pdserve") if importlib.util.find_spec(m)]
print(json.dumps({"text": result.text, "token_ids": result.token_ids, "heavy": heavy}))
"""


def test_sdk_installs_alone_and_generates(stack, tmp_path):
    # the SDK and the protos in the repository's layout, without anything built in the work tree
    tree = tmp_path / "repo"
    ignore = shutil.ignore_patterns("*.binpb", "*.egg-info", "build", "__pycache__")
    shutil.copytree(REPO / "libs" / "pdserve-sdk", tree / "libs" / "pdserve-sdk", ignore=ignore)
    shutil.copytree(REPO / "proto", tree / "proto")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", tree / "libs" / "pdserve-sdk"], capture_output=True, text=True
    )
    assert install.returncode == 0, install.stderr[-3000:]
    installed = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True)
    names = {p["name"].lower() for p in json.loads(installed.stdout)}
    assert {"pdserve-sdk", "grpcio", "protobuf"} <= names
    assert not names & {"torch", "transformers", "pdserve", "grpcio-tools"}

    run = subprocess.run(
        [python, "-c", SCRIPT, stack.grpc_address], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    with Client(stack.grpc_address) as client:
        expected = client.generate("The capital of France is", temperature=0, max_new_tokens=8)
    assert (out["text"], out["token_ids"], out["heavy"]) == (expected.text, expected.token_ids, [])
