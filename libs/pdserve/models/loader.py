"""Build a registered model and fill it from a safetensors checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pdserve.distributed import SINGLE_RANK, TpGroup
from pdserve.layers.linear import MergedLinear, default_weight_loader
from pdserve.layers.quantization import get_linear_method
from pdserve.models.config_checks import check_config
from pdserve.models.registry import get_model_class

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_TIED_EMBEDDING = "model.embed_tokens.weight"


def load_model(
    model_path: Path,
    hf_config,
    architecture: str,
    max_position: int,
    dtype: torch.dtype,
    device,
    quantization: str | None = None,
    tp: TpGroup = SINGLE_RANK,
    expert_parallel: bool = False,
) -> nn.Module:
    """Instantiate ``architecture`` with ``dtype`` parameters on ``device``, load its weights, then
    run each module's ``process_weights_after_loading`` (weight repacking or quantization),
    children first. ``quantization`` (``pdserve.layers.quantization``, resolved: not ``auto``)
    applies to every module with a ``quant_method`` slot (``Linear``s, MoE experts) but the LM
    head, which gets the method's own LM head format. Under TP (``tp``) the model holds, and reads
    from the checkpoint, only this rank's slices (``pdserve.layers.parallel_linear``); with
    ``expert_parallel`` its MoE layers hold whole experts instead of slices of every expert.

    Raises:
        ValueError: an unknown ``quantization``; a config field the model does not support (named).
    """
    method = get_linear_method(quantization)
    check_config(hf_config)
    model_class = get_model_class(architecture)
    if expert_parallel and not getattr(model_class, "has_experts", False):
        raise ValueError(f"--enable-expert-parallel: {architecture} has no mixture-of-experts layers")
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            kwargs = {"expert_parallel": True} if expert_parallel else {}
            model = model_class(hf_config, max_position, tp, **kwargs)
        finally:
            torch.set_default_dtype(previous)
    load_weights(model, Path(model_path))
    if method is not None:
        for name, module in model.named_modules():
            if hasattr(module, "quant_method") and name != "lm_head":
                module.quant_method = method
    for module in reversed(list(model.modules())):  # children before their parents
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    if method is not None and hasattr(model, "lm_head_packed"):  # the method's LM head format
        model.lm_head_packed = method.pack_lm_head(model.lm_head.weight)
    return model.eval()


def load_weights(model: nn.Module, model_path: Path) -> None:
    """Copy every ``*.safetensors`` tensor of ``model_path`` into its parameter.

    Checkpoint names are Hugging Face's; ``model.packed_modules_mapping`` maps fused ones
    (``q_proj`` → shard ``q`` of ``qkv_proj``), ``model.checkpoint_target(name)`` (where a model has
    one) any others (an MoE layer's experts), and a parameter's own ``weight_loader`` places them.
    Loaders get a lazy safetensors slice, so a tensor-parallel layer reads only its rank's rows or
    columns from the file.
    With tied embeddings a checkpoint may hold the shared matrix as ``lm_head.weight``, as
    ``model.embed_tokens.weight`` or both; either fills the one shared parameter.

    Raises:
        FileNotFoundError: no safetensors file in ``model_path``.
        KeyError: a checkpoint tensor has no parameter to go to.
        ValueError: some parameter got no value, or shapes differ.
    """
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors checkpoint in {model_path}")
    params = dict(model.named_parameters())
    mapping = getattr(model, "packed_modules_mapping", {})
    remap = getattr(model, "checkpoint_target", lambda name: None)
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: set[tuple[str, str | None]] = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as checkpoint:
            for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                target, shard = remap(name) or _target(name, mapping)
                if tied and target == "lm_head.weight":
                    target = _TIED_EMBEDDING
                if target not in params:
                    raise KeyError(
                        f"checkpoint tensor {name} has no parameter {target} in {type(model).__name__}"
                    )
                param = params[target]
                source = checkpoint.get_slice(name)
                if shard is None:
                    getattr(param, "weight_loader", default_weight_loader)(param, source)
                else:
                    param.weight_loader(param, source, shard)
                loaded.add((target, shard))
    missing = sorted({name for name, shard in _expected(params) if (name, shard) not in loaded})
    missing += [f"{prefix}.{shard}" for prefix, m in model.named_modules() if hasattr(m, "missing_shards")
                for shard in m.missing_shards()]  # fmt: skip
    if missing:
        raise ValueError(
            f"checkpoint {model_path} has no values for {missing[:8]}{'...' if len(missing) > 8 else ''}"
        )


def _expected(params: dict[str, nn.Parameter]) -> list[tuple[str, str | None]]:
    """Every (parameter, shard) pair a complete checkpoint fills (but those of modules that track
    their own shards: ``missing_shards``)."""
    pairs: list[tuple[str, str | None]] = []
    for name, param in params.items():
        owner = getattr(getattr(param, "weight_loader", None), "__self__", None)
        if hasattr(owner, "missing_shards"):
            continue
        pairs += (
            [(name, shard) for shard in owner.shards] if isinstance(owner, MergedLinear) else [(name, None)]
        )
    return pairs


def _target(name: str, mapping: dict[str, tuple[str, str]]) -> tuple[str, str | None]:
    """Parameter name and shard of checkpoint tensor ``name``."""
    for checkpoint_part, (fused_part, shard) in mapping.items():
        if f".{checkpoint_part}." in name:
            return name.replace(f".{checkpoint_part}.", f".{fused_part}."), shard
    return name, None
