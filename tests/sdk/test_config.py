"""Connection settings: retry service config, TLS validation, address/key resolution from the environment."""

from __future__ import annotations

import json

import pytest
from pdserve_sdk.config import ClientConfig, RetryPolicy, TlsConfig


def test_retry_policy_service_config():
    config = json.loads(RetryPolicy(max_retries=2, initial_backoff=0.25, max_backoff=1.5).service_config())
    (method,) = config["methodConfig"]
    assert method["name"] == [{}]  # every method of the channel
    assert method["retryPolicy"] == {
        "maxAttempts": 3,
        "initialBackoff": "0.250000000s",
        "maxBackoff": "1.500000000s",
        "backoffMultiplier": 2.0,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    assert "retryPolicy" not in json.loads(RetryPolicy(max_retries=0).service_config())["methodConfig"][0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_retries": 5},
        {"max_retries": -1},
        {"initial_backoff": 0},
        {"initial_backoff": 3, "max_backoff": 2},
        {"backoff_multiplier": 0.5},
    ],
)
def test_retry_policy_rejects_out_of_range(kwargs):
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


def test_mtls_needs_cert_and_key():
    with pytest.raises(ValueError, match="both"):
        TlsConfig(certificate_chain=b"cert")


def test_resolve_from_arguments_environment_and_defaults(monkeypatch):
    monkeypatch.delenv("PDSERVE_ADDRESS", raising=False)
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    config = ClientConfig.resolve(None, None, None, None)
    assert (config.target, config.api_key, config.tls, config.retry) == (
        "127.0.0.1:50051",
        None,
        None,
        RetryPolicy(),
    )
    assert config.metadata() == ()

    monkeypatch.setenv("PDSERVE_ADDRESS", "gw:1234")
    monkeypatch.setenv("PDSERVE_API_KEY", "env-key")
    config = ClientConfig.resolve(None, None, True, None)
    assert (config.target, config.api_key, config.tls) == ("gw:1234", "env-key", TlsConfig())
    assert config.metadata() == (("authorization", "Bearer env-key"),)

    config = ClientConfig.resolve(
        "x:1", "arg-key", TlsConfig(server_name="gw.test"), RetryPolicy(max_retries=1)
    )
    assert (config.target, config.api_key, config.retry.max_retries) == ("x:1", "arg-key", 1)
    options = dict(config.options())
    assert options["grpc.ssl_target_name_override"] == "gw.test"
    assert json.loads(options["grpc.service_config"])["methodConfig"][0]["retryPolicy"]["maxAttempts"] == 2
