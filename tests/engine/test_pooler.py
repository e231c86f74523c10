"""The pooling rule (``pdserve.layers.pooler``): which pooling a checkpoint's files imply, and how a
prompt pooled in chunks gives the same embedding as one pass (a mean summed chunk by chunk)."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.layers.pooler import PoolingRows, accumulate, finish, model_pooling


def _sentence_transformers(path, **modes) -> None:
    (path / "modules.json").write_text(
        json.dumps([{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
                    {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    )  # fmt: skip
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **modes}))


@pytest.mark.parametrize(
    ("modes", "expected"),
    [
        ({"pooling_mode_mean_tokens": True}, "mean"),
        ({"pooling_mode_lasttoken": True}, "last"),
        ({"pooling_mode_cls_token": True}, None),
    ],
)
def test_a_sentence_transformers_config_names_the_pooling(tmp_path, modes, expected):
    _sentence_transformers(tmp_path, **modes)
    assert model_pooling(tmp_path) == expected


def test_a_plain_decoder_pools_its_last_token(tmp_path):
    assert model_pooling(tmp_path) == "last"


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_chunks_pool_as_one_pass(kind):
    torch.manual_seed(0)
    hidden = torch.randn(10, 8)
    whole = PoolingRows([kind]).compute(hidden, torch.tensor([0]), torch.tensor([10]))[0]
    pooled = None
    for start, n in [(0, 4), (4, 4), (8, 2)]:  # the same prompt in three chunks
        part = PoolingRows([None, kind]).compute(hidden, torch.tensor([0, start]), torch.tensor([1, n]))
        assert part[0] is None
        pooled = accumulate(pooled, part[1], kind)
    expected = hidden.mean(0) if kind == "mean" else hidden[-1]
    expected = torch.nn.functional.normalize(expected, dim=0)
    assert torch.allclose(torch.tensor(finish(pooled, kind, 10)), expected, atol=1e-6)
    assert torch.allclose(torch.tensor(finish(whole, kind, 10)), expected, atol=1e-6)
