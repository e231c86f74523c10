"""The engine benchmark end to end on a small random model: a table, then one strict-JSON last line;
with ``--tp-size 1,2`` also the engine on two tensor-parallel rank processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _strict(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


def test_last_line_is_strict_json_with_and_without_hf(tmp_path: Path) -> None:
    config = json.loads((REPO / "benchmarks/configs/smollm2-135m-instruct.json").read_text())
    config |= {"num_hidden_layers": 2, "hidden_size": 192, "num_attention_heads": 4, "num_key_value_heads": 1}
    config |= {"intermediate_size": 256, "vocab_size": 512}
    model = tmp_path / "config.json"
    model.write_text(json.dumps(config))
    args = ["--model", str(model), "--batch-sizes", "1,2", "--prompt-len", "8", "--new-tokens", "4"]
    for extra in (["--skip-hf", "--tp-size", "1,2"], []):
        run = subprocess.run(
            [sys.executable, "-m", "benchmarks.engine", *args, *extra],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-6000:]
        lines = run.stdout.strip().splitlines()
        result = json.loads(lines[-1], parse_constant=_strict)  # NaN / Infinity would raise
        assert any(line.split()[:3] == ["1", "bfloat16", "2"] for line in lines[:-1])  # the table's row
        for dtype in ("float32", "bfloat16"):
            assert result[f"{dtype}_b2_engine_tok_s"] > 0 and result[f"{dtype}_b2_prefill_tok_s"] > 0
            if extra:
                assert result[f"{dtype}_b2_hf_tok_s"] is None and result[f"{dtype}_b2_ratio"] is None
                assert result[f"tp2_{dtype}_b2_engine_tok_s"] > 0 and result[f"tp2_{dtype}_b2_ratio"] is None
            else:
                ratio = result[f"{dtype}_b2_engine_tok_s"] / result[f"{dtype}_b2_hf_tok_s"]
                assert abs(result[f"{dtype}_b2_ratio"] - ratio) < 1e-2
