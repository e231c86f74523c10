"""The real default-model tokenizer, loaded once for this package."""

from __future__ import annotations

import pytest

from pdserve.tokenization import Tokenizer


@pytest.fixture(scope="package")
def tokenizer() -> Tokenizer:
    return Tokenizer.load()
