"""The speculative-decoding engine benchmark end to end on the tiny random checkpoint: its tables, then
one strict-JSON last line with a step time per (batch, k), break-even rates and n-gram counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.serving_lib.tiny_model import tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]


def _strict(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


def test_tables_and_a_strict_json_last_line() -> None:
    args = ["--model", str(tiny_checkpoint()), "--dtypes", "float32+w4a8", "--batch-sizes", "1,2"]
    args += ["--ks", "0,2", "--repeats", "1", "--prompts", "2", "--new-tokens", "8", "--prompt-len", "16"]
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.speculative", *args, "--clock", "cpu"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-6000:]
    lines = run.stdout.strip().splitlines()
    result = json.loads(lines[-1], parse_constant=_strict)
    assert result["clock"] == "cpu" and result["threads"] == 1
    for batch in (1, 2):
        assert result[f"float32_w4a8_b{batch}_k0_ms"] > 0 and result[f"float32_w4a8_b{batch}_k2_ms"] > 0
        assert result[f"float32_w4a8_b{batch}_k0_break_even"] == 0.0
    for kind in ("random", "grounded"):
        drafts = result[f"ngram_{kind}_ignore_eos_spec_decode_num_draft_tokens"]
        accepted = result[f"ngram_{kind}_ignore_eos_spec_decode_num_accepted_tokens"]
        assert 0 <= accepted <= drafts
        assert result[f"e2e_b1_{kind}_plain_tok_s"] > 0 and result[f"e2e_b1_{kind}_ngram_tok_s"] > 0
    assert any(line.split()[:1] == ["2"] for line in lines[:-1])  # the batch-2 row of the step table
