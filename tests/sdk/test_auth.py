"""API keys: the SDK against a stack launched with ``--api-key``."""

from __future__ import annotations

import grpc
import pytest
from pdserve_sdk import AuthenticationError, Client

from tests.sdk.conftest import API_KEY


@pytest.mark.parametrize("key", ["wrong", ""])
def test_wrong_or_missing_key_raises_authentication_error(auth_stack, key):
    with Client(auth_stack.grpc_address, api_key=key) as client:
        with pytest.raises(AuthenticationError) as info:
            client.generate("Hi", max_new_tokens=2)
        assert info.value.code is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(AuthenticationError):
            client.models()
        assert client.health() == "SERVING"  # health stays open, as for load balancers


def test_right_key_generates(auth_stack, monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", API_KEY)
    with Client(auth_stack.grpc_address) as client:
        result = client.generate("Hi", temperature=0, max_new_tokens=4)
    assert result.usage.completion_tokens == len(result.token_ids) > 0
