"""KVLayout / KVAgentInfo: compatibility errors, page size in bytes, parity with the protobuf messages."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.kv_transfer import POOL_LAYOUT, KVAgentInfo, KVLayout, KVLayoutMismatch, check_compatible
from pdserve.v1 import scheduler_pb2

SMOL = KVLayout(
    model="SmolLM2-135M-Instruct", dtype="bfloat16", page_size=16, num_layers=30, num_kv_heads=3, head_dim=64
)


def test_equal_layouts_are_compatible():
    check_compatible(SMOL, dataclasses.replace(SMOL))


def test_mismatch_names_every_differing_field():
    remote = dataclasses.replace(SMOL, page_size=32, dtype="float32")
    with pytest.raises(KVLayoutMismatch) as err:
        check_compatible(SMOL, remote)
    text = str(err.value)
    assert "page_size: local 16, remote 32" in text
    assert "dtype: local 'bfloat16', remote 'float32'" in text
    assert "num_layers" not in text and "model" not in text


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_page_bytes_is_one_page_of_the_pool_tensor(dtype: str):
    layout = dataclasses.replace(SMOL, dtype=dtype)
    pool = torch.zeros(3, 30, 2, 16, 3, 64, dtype=getattr(torch, dtype))  # [pages, layers, k/v, ...]
    assert layout.page_bytes == pool[0].numel() * pool.element_size()


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="unknown KV dtype"):
        _ = dataclasses.replace(SMOL, dtype="float9").page_bytes


def test_dataclasses_match_the_protobuf_messages_field_for_field():
    for cls, message in ((KVLayout, scheduler_pb2.KVLayout), (KVAgentInfo, scheduler_pb2.KVAgentInfo)):
        own = [f.name for f in message.DESCRIPTOR.fields if f.name != "tp_rank_agents"]  # a TP handshake's
        assert [f.name for f in dataclasses.fields(cls)] == own
    info = KVAgentInfo("decode-1", b"\x00md", SMOL, 2**40 + 64, 123456, -1, 512, "abc")
    pb = scheduler_pb2.KVAgentInfo(**{**vars(info), "layout": scheduler_pb2.KVLayout(**vars(info.layout))})
    back = KVAgentInfo(
        **{f.name: getattr(pb, f.name) for f in dataclasses.fields(KVAgentInfo) if f.name != "layout"},
        layout=KVLayout(**{f.name: getattr(pb.layout, f.name) for f in dataclasses.fields(KVLayout)}),
    )
    assert back == info
    assert SMOL.layout == POOL_LAYOUT
    assert info.mem_type == "DRAM" and dataclasses.replace(info, device_id=0).mem_type == "VRAM"
