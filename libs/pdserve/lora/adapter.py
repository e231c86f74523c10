"""Reading one LoRA adapter in PEFT's format (Hu et al. 2021, "LoRA"): ``adapter_config.json`` and
``adapter_model.safetensors`` of a directory ``save_pretrained`` wrote.

Each target linear ``W`` ``[out, in]`` of the base gains ``scaling * B @ A`` with ``A`` ``[r, in]``
and ``B`` ``[out, r]``; ``scaling`` is ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` where the
config sets ``use_rslora`` (Kalajdzievski 2023, rank-stabilized LoRA). ``load_adapter`` folds the
scaling into ``B``. Only what the serving path runs is accepted: the attention and MLP projections
of the decoder layers, no bias, no DoRA, one rank and one alpha for every module.
"""

from __future__ import annotations

import json
import math
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

# PEFT's names of the projections the serving path adapts (Llama-family module names)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json is a few hundred bytes; bounds a hostile path's read


class LoraAdapterError(ValueError):
    """An adapter that cannot be served on this base (bad path, rank, module or shape): HTTP 400."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights, by ``(layer, module)``: ``A`` ``[r, in]`` and ``B * scaling``
    ``[out, r]``, float32 on the CPU."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _check_regular(file: Path, max_bytes: int | None = None) -> None:
    """Refuse what is not a regular file (a FIFO or a device such as /dev/zero would block or never
    end the read on the scheduler thread) or is over ``max_bytes``; raises ``OSError``/``ValueError``."""
    info = file.stat()
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{file.name} is not a regular file")
    if max_bytes is not None and info.st_size > max_bytes:
        raise ValueError(f"{file.name} has {info.st_size} bytes, over {max_bytes}")


def _rank_and_alpha(path: Path, config: dict) -> tuple[int, float]:
    """``r`` and ``lora_alpha`` as numbers (PEFT writes an int and a number)."""
    rank, alpha = config.get("r", 0), config.get("lora_alpha", 0)
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise LoraAdapterError(f"{path}: r must be an integer (got {rank!r})")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoraAdapterError(f"{path}: lora_alpha must be a finite number (got {alpha!r})")
    return rank, float(alpha)


def _read_config(path: Path) -> dict:
    file = path / "adapter_config.json"
    try:
        _check_regular(file, MAX_CONFIG_BYTES)
        config = json.loads(file.read_bytes())
    except (OSError, ValueError) as e:
        raise LoraAdapterError(f"{path}: no readable PEFT adapter_config.json ({e})") from e
    if not isinstance(config, dict):
        raise LoraAdapterError(f"{path}: adapter_config.json is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"{path}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    unsupported = {
        "bias": config.get("bias", "none") != "none",
        "use_dora": bool(config.get("use_dora")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
    }
    if any(unsupported.values()):
        raise LoraAdapterError(
            f"{path}: unsupported adapter options {[k for k, v in unsupported.items() if v]}"
        )
    return config


def load_adapter(
    name: str, path: str | Path, max_rank: int, shapes: dict[tuple[int, str], tuple[int, int]]
) -> LoraAdapter:
    """Read and check the PEFT adapter at ``path``.

    Args:
        name: the adapter's served name (the requests' ``model``).
        path: directory holding ``adapter_config.json`` and ``adapter_model.safetensors``.
        max_rank: ``--max-lora-rank``.
        shapes: ``(layer, module) -> (out, in)`` of every linear of the base an adapter may target
            (full, unsharded shapes).

    Raises:
        LoraAdapterError: unreadable files (or not regular files, or an adapter_config.json over
            ``MAX_CONFIG_BYTES``), a config that is not a JSON object or whose ``r``/``lora_alpha``
            are not numbers, a rank above ``max_rank``, an unsupported option, a
            module the base does not have (or not one of ``TARGET_MODULES``), or a shape that does
            not fit the base.
    """
    path = Path(path)
    config = _read_config(path)
    rank, alpha = _rank_and_alpha(path, config)
    if not 0 < rank <= max_rank:
        raise LoraAdapterError(f"{path}: rank {rank} is outside [1, --max-lora-rank {max_rank}]")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    try:
        _check_regular(path / "adapter_model.safetensors")
        tensors = load_file(path / "adapter_model.safetensors")
    except (OSError, ValueError) as e:
        raise LoraAdapterError(f"{path}: no readable adapter_model.safetensors ({e})") from e
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or (int(match[1]), match[2]) not in shapes:
            raise LoraAdapterError(f"{path}: weight {key} targets a module the base model does not have")
        halves.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        out_features, in_features = shapes[(layer, module)]
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None or a.shape != (rank, in_features) or b.shape != (out_features, rank):
            shape = lambda t: None if t is None else tuple(t.shape)
            raise LoraAdapterError(
                f"{path}: layer {layer} {module}: lora_A {shape(a)} and lora_B {shape(b)} do not fit "
                f"[{rank}, {in_features}] and [{out_features}, {rank}]"
            )
        weights[(layer, module)] = (a.float(), b.float() * scaling)
    if not weights:
        raise LoraAdapterError(f"{path}: the adapter holds no LoRA weights")
    return LoraAdapter(name, rank, weights)
