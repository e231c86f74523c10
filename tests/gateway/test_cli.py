"""Gateway flags: env defaults (PDSERVE_<FLAG>), required backends, the served model name."""

from __future__ import annotations

import pytest

from pdserve.model_source import DEFAULT_MODEL_NAME, resolve_model, served_model_name
from pdserve.services.common.chat_parser_args import TOOL_CALL_PARSERS
from pdserve.services.gateway.main import parse_args
from pdserve.services.gateway.openai.tool_parsers import TOOL_PARSERS

BACKENDS = ["--tokenizer-addresses", "t:1", "--decode-addresses", "d:1,d:2", "--detokenizer-addresses", "k:1"]


def test_env_supplies_flags_and_flags_win(monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_API_KEY", "sk-env")
    monkeypatch.setenv("PDSERVE_MAX_PENDING_REQUESTS", "7")
    monkeypatch.setenv("PDSERVE_ROUTER_POLICY", "least_load")
    args = parse_args(BACKENDS)
    assert (args.api_key, args.max_pending_requests, args.router_policy) == ("sk-env", 7, "least_load")
    assert (args.port, args.grpc_port, args.host) == (8000, 50051, "127.0.0.1")
    assert (args.internal_host, args.internal_grpc_port, args.advertise_host) == ("127.0.0.1", 0, None)
    assert parse_args([*BACKENDS, "--api-key", "sk-flag"]).api_key == "sk-flag"


def test_backends_are_required(monkeypatch) -> None:
    monkeypatch.delenv("PDSERVE_DECODE_ADDRESSES", raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--tokenizer-addresses", "t:1", "--detokenizer-addresses", "k:1"])


def test_served_name_of_the_default_model_and_its_cache_dir(tmp_path) -> None:
    assert served_model_name(None) == DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    assert served_model_name(str(resolve_model())) == DEFAULT_MODEL_NAME
    assert served_model_name(str(tmp_path / "Llama-3.2-1B")) == "Llama-3.2-1B"
    assert served_model_name(str(tmp_path / "qwen.gguf")) == "qwen"


def test_the_flag_names_every_tool_call_format_the_gateway_has() -> None:
    """``--tool-call-parser`` checks its value against names the launcher shares without importing the
    gateway (``services.common.chat_parser_args``): they must be exactly the gateway's formats."""
    assert sorted(TOOL_CALL_PARSERS) == sorted(TOOL_PARSERS)
    for name in TOOL_CALL_PARSERS:
        assert parse_args([*BACKENDS, "--tool-call-parser", name]).tool_call_parser == name
