"""The check that a draft model speaks the target's vocabulary: its token ids must mean the same
tokens, or its drafts would be other text than they look."""

from __future__ import annotations

from pathlib import Path


def check_same_vocabulary(target_path: str | Path, draft_path: str | Path) -> None:
    """Refuse a draft checkpoint whose tokenizer or vocabulary differs from the target's.

    Compares the model configs' ``vocab_size`` (the logits' width) and the tokenizers' token-to-id
    maps (added and special tokens included), as Hugging Face transformers loads them.

    Raises:
        ValueError: naming both checkpoints and the first difference found.
    """
    from transformers import AutoConfig, AutoTokenizer

    sizes = [AutoConfig.from_pretrained(p).vocab_size for p in (target_path, draft_path)]
    where = f"draft model {draft_path} cannot draft for target model {target_path}"
    if sizes[0] != sizes[1]:
        raise ValueError(f"{where}: vocab_size {sizes[1]} differs from the target's {sizes[0]}")
    target, draft = (AutoTokenizer.from_pretrained(p).get_vocab() for p in (target_path, draft_path))
    if target != draft:
        ids = {i: t for t, i in target.items()}
        other = {i: t for t, i in draft.items()}
        first = min(set(ids.items()) ^ set(other.items()))[0]
        raise ValueError(
            f"{where}: their tokenizers differ ({len(draft)} tokens vs the target's {len(target)}; "
            f"id {first} is {other.get(first)!r} in the draft, {ids.get(first)!r} in the target)"
        )
