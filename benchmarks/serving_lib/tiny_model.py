"""A near-free model for measuring the serving path: a random-weight Llama of 2 layers and hidden size 128
with the default model's tokenizer, built once into the pdserve cache.

Its forward costs a small fraction of what the Python around it costs (gRPC, scheduling, detokenizing,
HTTP), so a benchmark that serves it measures the serving path's own ceiling. Its outputs are random
tokens of the real vocabulary, so the tokenizer, detokenizer and stop handling do real work.
"""

from __future__ import annotations

import fcntl
import json
import shutil
from pathlib import Path

from pdserve.model_source import cache_dir, resolve_model

# the shape the serving-path measurements of issue 20 used; every other field is the default model's
TINY_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
}
_SEED = 0


def tiny_checkpoint() -> Path:
    """The checkpoint directory (built on first use, under ``$PDSERVE_CACHE_DIR``; concurrent callers
    wait on a file lock): config.json, model.safetensors (float32, seed 0) and the tokenizer files of
    the default model."""
    source = resolve_model()
    out = cache_dir() / f"tiny-llama-{source.name}"
    if (out / "config.json").exists():
        return out
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").exists():
            return out
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = json.loads((source / "config.json").read_text()) | TINY_SHAPE
        config.pop("_model_name_or_path", None)
        tmp = out.parent / f".{out.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(config))
        torch.manual_seed(_SEED)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp), dtype=torch.float32)
        model.save_pretrained(tmp)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (source / name).exists():
                shutil.copy(source / name, tmp / name)
        tmp.rename(out)
    return out
