"""What a Hugging Face config says about each layer's attention, and the config fields the engine
refuses at start-up (named in the error) rather than serving wrongly or failing on a request."""

from __future__ import annotations

from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention")


def check_config(config: Any) -> None:
    """Refuse, at load, what no model here implements.

    Raises:
        ValueError: naming the field: a pre-quantized checkpoint (``quantization_config``: the
            engine quantizes float checkpoints at load, ``--quantization``), a layer type other than
            full or sliding-window attention (``layer_types``), bidirectional attention
            (``use_bidirectional_attention``).
    """
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ValueError(
            f"quantization_config {method!r}: pre-quantized checkpoints are not supported; serve a float "
            "checkpoint (bfloat16 / float16 / float32) and choose --quantization to quantize it at load"
        )
    unknown = sorted(set(getattr(config, "layer_types", None) or ()) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (only {list(LAYER_TYPES)})")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention is not supported (causal attention only)")


def layer_sliding_window(config: Any, layer_id: int) -> int:
    """Keys a query of layer ``layer_id`` attends, Hugging Face's ``sliding_window`` (the query at
    position ``p`` sees ``(p - sliding_window, p]``), for a sliding-window layer; 0 for full attention.

    ``layer_types`` (Gemma 3, gpt-oss, Qwen2/3 with ``use_sliding_window``) says which layers slide;
    without it a config's ``sliding_window`` applies to every layer (Mistral, Mixtral, Qwen3-MoE),
    as transformers' masks apply it. Configs that turn the window off set it to None.
    """
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    if not window or layer_types is None:
        return window
    return window if layer_types[layer_id] == "sliding_attention" else 0
