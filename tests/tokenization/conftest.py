"""The real default-model tokenizer, loaded once per test session."""

from __future__ import annotations

import pytest

from pdserve.tokenization import Tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.load()
