"""Which slice of a checkpoint tensor each TP rank holds (Megatron-LM's column/row split; SGLang's
rule for KV heads when there are fewer of them than ranks)."""

from __future__ import annotations

from typing import NamedTuple


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, count)`` of part ``index`` when ``n`` items are cut into ``parts`` consecutive parts
    as equal as possible (the first ``n % parts`` parts one item longer)."""
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (index < extra)


class HeadShard(NamedTuple):
    """The attention heads one rank holds: query heads ``[q_start, q_start + num_heads)`` and KV
    heads ``[kv_start, kv_start + num_kv_heads)``."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadShard:
    """The heads of ``rank``: whole GQA groups (a KV head with its query heads) split as evenly as
    the groups allow when there are at least as many KV heads as ranks (SmolLM2's 3 groups over 2
    ranks: 2 and 1, so 6 and 3 query heads); with fewer KV heads than ranks each KV head is
    replicated on ``tp_size / num_kv_heads`` consecutive ranks, which split its query heads, so a
    rank's query heads always find their KV head locally.

    Raises:
        ValueError: fewer KV heads than ranks and the TP size is not a multiple of them or does not
            divide the query heads.
    """
    group = num_heads // num_kv_heads
    if tp_size <= num_kv_heads:
        kv_start, kv_heads = split_range(num_kv_heads, tp_size, rank)
        return HeadShard(kv_start * group, kv_heads * group, kv_start, kv_heads)
    if tp_size % num_kv_heads or num_heads % tp_size:
        raise ValueError(
            f"TP size {tp_size} exceeds the {num_kv_heads} KV heads: it must be a multiple of them"
            f" and divide the {num_heads} attention heads"
        )
    heads = num_heads // tp_size
    return HeadShard(rank * heads, heads, rank * num_kv_heads // tp_size, 1)


def vocab_shard(vocab_size: int, tp_size: int, rank: int) -> tuple[int, int, int]:
    """``(start, end, rows)``: ``rank`` holds vocabulary rows ``[start, end)`` in a shard of ``rows =
    ceil(vocab_size / tp_size)`` rows (the last rank's tail is zero padding), so the ranks' logits
    gather into equal parts whose concatenation, cut at ``vocab_size``, is the full row."""
    rows = -(-vocab_size // tp_size)
    start = min(rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows
