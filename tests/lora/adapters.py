"""Random-weight PEFT LoRA adapters on SmolLM2-135M, made with the ``peft`` package, and HF PEFT's
fp32 greedy outputs under each of them (the reference the engine and the stacks are compared with)."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, targets, rsLoRA); "poet" has a lower rank, fewer modules and rsLoRA scaling
ADAPTERS = {"pirate": (8, 16, ALL_TARGETS, False), "poet": (4, 8, ["q_proj", "v_proj", "down_proj"], True)}


def make_adapters(
    root: Path, adapters: dict = ADAPTERS, base_path: Path | None = None
) -> tuple[object, dict[str, Path]]:
    """Save ``adapters`` (as ``ADAPTERS``; non-zero random ``A`` and ``B``) of the checkpoint at
    ``base_path`` (default: SmolLM2-135M) under ``root``; returns the fp32 PEFT model holding all of
    them (eval) and each adapter's directory."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from pdserve.model_source import resolve_model

    base = AutoModelForCausalLM.from_pretrained(base_path or resolve_model(), dtype=torch.float32).eval()
    model: PeftModel | None = None
    paths = {}
    torch.manual_seed(0)
    for name, (rank, alpha, targets, rslora) in adapters.items():
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora)
        if model is None:
            model = get_peft_model(base, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
        for param_name, param in model.named_parameters():
            if f"lora_B.{name}." in param_name:  # PEFT starts B at zero: the adapter would be a no-op
                param.data.normal_(0.0, 0.2)
        model.save_pretrained(root, selected_adapters=[name])
        paths[name] = root / name if (root / name).is_dir() else root
    return model.eval(), paths


def peft_greedy(model, adapter: str | None, prompt: list[int], new_tokens: int) -> list[int]:
    """HF PEFT's greedy ``new_tokens`` after ``prompt`` under ``adapter`` (None: the base model)."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        else:
            model.set_adapter(adapter)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    return out[0, len(prompt) :].tolist()
