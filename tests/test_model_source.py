"""``--model`` resolution: a GGUF's safetensors cache is named by the file's contents and holds its
weights in the GGUF's natural dtype."""

from __future__ import annotations

import shutil

from pdserve.model_source import _content_key, default_gguf_path, gguf_dtype, resolve_model


def test_cache_key_follows_contents_not_location(tmp_path):
    """The same GGUF in two checkouts shares one converted cache; another file does not."""
    original = tmp_path / "a" / "model.gguf"
    original.parent.mkdir()
    original.write_bytes(bytes(range(256)) * 80_000)  # 20 MB: head and tail samples differ from the middle
    copy = tmp_path / "b" / "model.gguf"
    copy.parent.mkdir()
    shutil.copy(original, copy)
    assert _content_key(original) == _content_key(copy)
    data = bytearray(original.read_bytes())
    data[-1] ^= 1  # the last weight changed
    copy.write_bytes(data)
    assert _content_key(original) != _content_key(copy)
    copy.write_bytes(original.read_bytes()[:-1])  # truncated
    assert _content_key(original) != _content_key(copy)


def test_default_gguf_converts_to_float16_equal_to_transformers_float32_dequantization():
    """The converted cache holds, tensor for tensor, transformers' own float32 dequantization of the
    GGUF rounded to float16 (the GGUF's natural dtype: fp16 block scales), within 2^-11 relative."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    assert gguf_dtype(gguf) == torch.float16
    converted = load_file(resolve_model() / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    weights = reference.state_dict()
    assert set(converted) <= set(weights) and len(converted) >= len(weights) - 1  # lm_head may be tied
    for name, tensor in converted.items():
        assert tensor.dtype == torch.float16, name
        assert torch.equal(tensor, weights[name].to(torch.float16)), name
        assert torch.allclose(tensor.float(), weights[name], rtol=2**-11, atol=2**-24), name


def test_fresh_conversion_warns_nothing_and_matches_the_cache(tmp_path, monkeypatch, capfd):
    """A first conversion (an empty cache) logs no transformers warning (it once warned that a float16
    load of packed GGUF blocks is slow, about a load that dequantizes) and writes what the shared
    cache holds: equal tensors (the safetensors header's order of names varies from run to run), the
    other files byte for byte."""
    import torch
    from safetensors.torch import load_file

    from pdserve.model_source import convert_gguf

    cached = resolve_model()
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    fresh = convert_gguf(default_gguf_path())
    assert fresh.parent == tmp_path and fresh.name == cached.name
    assert "[transformers]" not in capfd.readouterr().err
    assert sorted(p.name for p in fresh.iterdir()) == sorted(p.name for p in cached.iterdir())
    weights, reference = load_file(fresh / "model.safetensors"), load_file(cached / "model.safetensors")
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[name], reference[name]) for name in reference)
    for path in cached.iterdir():
        if path.name != "model.safetensors":
            assert (fresh / path.name).read_bytes() == path.read_bytes(), path.name
