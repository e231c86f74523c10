"""Which prefill rank writes which KV heads into which decode rank, for TP groups of any two sizes.

Each rank's pool holds a contiguous range of the model's KV heads (``KVLayout.kv_heads``: whole
GQA groups split over the ranks, or one head replicated on several ranks when there are fewer heads
than ranks, ``distributed.sharding.head_shard``). For every decode rank ``d`` and every head ``h`` it
holds, exactly one prefill rank writes ``h``: rank ``d`` itself where it holds ``h`` (so equal TP
sizes keep prefill rank ``i`` -> decode rank ``i``, whole pages), else the lowest rank holding it.
The heads one prefill rank writes into one decode rank form one ``HeadSlice`` (vLLM's NIXL connector
and SGLang's disaggregation pair heterogeneous TP ranks the same way: by head ranges).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pdserve.kv_transfer.errors import KVLayoutMismatch
from pdserve.kv_transfer.layout import KVLayout, check_compatible


class HeadSlice(NamedTuple):
    """Heads ``[src_head, src_head + num_heads)`` of the sender's pool go to heads ``[dst_head,
    dst_head + num_heads)`` of the receiver's (indices along each pool's own ``head`` axis)."""

    src_head: int
    dst_head: int
    num_heads: int


class HeadRoute(NamedTuple):
    """Prefill rank ``src_rank`` writes ``heads`` into decode rank ``dst_rank``; ``heads`` is None when
    the two pools hold the same heads (whole pages move)."""

    src_rank: int
    dst_rank: int
    heads: HeadSlice | None


def head_map(decode: Sequence[KVLayout], prefill: Sequence[KVLayout]) -> list[HeadRoute]:
    """Every (prefill rank, decode rank) pair that moves KV, and the heads it moves.

    Args:
        decode, prefill: every rank's layout of each group, rank order.

    Returns:
        The routes, by decode rank then prefill rank; every head of every decode rank in exactly one.

    Raises:
        KVLayoutMismatch: the groups differ in the model's KV geometry (dtype, page size, layers, KV
            heads, head size, local layers), a group's ranks are not ``0..tp_size-1``, a decode head
            is held by no prefill rank, one pair's heads are not one range, or the sizes differ with a
            local layers' pool (head-sliced transfers of an SWA pool are not built). The message names
            both sides' TP sizes and head ranges.
    """
    where = _describe(decode, prefill)
    try:
        for side, group in (("decode", decode), ("prefill", prefill)):
            for rank, layout in enumerate(group):
                if (layout.tp_rank, layout.tp_size) != (rank, len(group)):
                    raise KVLayoutMismatch(f"the {side} ranks are not 0..tp_size-1 of one group")
                if layout.kv_head_start < 0 or layout.kv_heads.stop > layout.model_kv_heads:
                    raise KVLayoutMismatch(f"{side} rank {rank} holds KV heads the model lacks")
                check_compatible(group[0], layout, (f"{side} rank 0", f"{side} rank {rank}"))
        check_compatible(decode[0], prefill[0], ("decode", "prefill"))
        routes = [route for d, layout in enumerate(decode) for route in _senders(d, layout, prefill)]
    except KVLayoutMismatch as e:
        raise KVLayoutMismatch(f"{e} ({where})") from None
    if decode[0].num_local_layers and any(route.heads is not None for route in routes):
        raise KVLayoutMismatch(
            "head-sliced KV transfers (prefill and decode of different TP sizes) do not support a"
            f" local layers' pool (--swa-full-tokens-ratio): use equal TP sizes ({where})"
        )
    return routes


def _senders(d: int, dst: KVLayout, prefill: Sequence[KVLayout]) -> list[HeadRoute]:
    """The prefill ranks writing decode rank ``d``'s heads (see the module docstring)."""
    owners: list[int] = []
    for h in dst.kv_heads:
        holders = [p for p, src in enumerate(prefill) if h in src.kv_heads]
        if not holders:
            raise KVLayoutMismatch(f"KV head {h} of decode rank {d} is held by no prefill rank")
        owners.append(d if d in holders else holders[0])
    routes: list[HeadRoute] = []
    for p in dict.fromkeys(owners):
        first = owners.index(p)
        count = owners.count(p)
        if owners[first : first + count] != [p] * count:
            raise KVLayoutMismatch(f"prefill rank {p} would write decode rank {d} two ranges of heads")
        src = prefill[p]
        h = dst.kv_head_start + first
        heads = HeadSlice(h - src.kv_head_start, first, count)
        whole = src.kv_heads == dst.kv_heads
        routes.append(HeadRoute(p, d, None if whole else heads))
    return routes


def _describe(decode: Sequence[KVLayout], prefill: Sequence[KVLayout]) -> str:
    """``"decode TP=1 holds KV heads [0, 4); prefill TP=2 holds [0, 2), [2, 4)"``."""

    def heads(group: Sequence[KVLayout]) -> str:
        return ", ".join(f"[{g.kv_heads.start}, {g.kv_heads.stop})" for g in group)

    return (
        f"decode TP={len(decode)} holds KV heads {heads(decode)};"
        f" prefill TP={len(prefill)} holds {heads(prefill)}"
    )
