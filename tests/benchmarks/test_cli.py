"""The serving benchmark's command line: defaults, targets, and a run whose server refuses every request."""

from __future__ import annotations

import json

import pytest

from benchmarks.serving import config_from_args, lora_flags, main, openai_base_url, parse_args
from benchmarks.serving_lib.adapters import model_shapes
from benchmarks.serving_lib.launch import LaunchSpec, parse_compare
from benchmarks.serving_lib.priority import PriorityLoad
from benchmarks.serving_lib.tokens import TokenCounter, estimate_tokens
from pdserve.model_source import resolve_model
from tests.stack import free_port_block


@pytest.fixture
def closed_url() -> str:
    """A localhost URL where nothing listens (connections are refused)."""
    return f"http://127.0.0.1:{free_port_block(1)}"


def test_defaults_follow_the_workload():
    random_cfg = config_from_args(parse_args([]))
    assert (random_cfg.mode, random_cfg.levels, random_cfg.output_tokens) == ("concurrency", [1, 16, 64], 64)
    assert (random_cfg.requests_at(1), random_cfg.requests_at(64)) == (8, 128)
    assert random_cfg.ignore_eos and random_cfg.prompt_tokens == 128
    shared = config_from_args(parse_args(["--workload", "shared-prefix", "--request-rate", "0.5,2"]))
    assert (shared.mode, shared.levels, shared.output_tokens, shared.requests_at(2.0)) == (
        "request_rate",
        [0.5, 2.0],
        32,
        64,
    )
    assert not config_from_args(parse_args(["--no-ignore-eos"])).ignore_eos
    prio = config_from_args(parse_args(["--workload", "priority", "--concurrency", "12", "--probes", "3"]))
    assert prio.priority == PriorityLoad(load=12, probes=3, probe_interval_s=1.0, high=-10, low=10)
    assert config_from_args(parse_args([])).priority is None
    with pytest.raises(SystemExit):
        parse_args(["--base-url", "http://x", "--launch", "--colocated"])
    assert parse_args([]).repeat == 1 and parse_args(["--repeat", "3"]).repeat == 3
    for bad in (["--repeat", "0"], ["--base-url", "http://x", "--repeat", "2"]):  # a running server runs once
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_lora_mix_launches_every_adapter_it_spreads_requests_over(tmp_path):
    cfg = config_from_args(parse_args(["--lora-mix", "0,1,3", "--lora-rank", "4"]))
    assert (cfg.lora_mix, cfg.lora_rank) == ([0, 1, 3], 4)
    flags = lora_flags(cfg, LaunchSpec("a b", "--colocated"), tmp_path).split()
    assert flags[0] == "--lora-modules" and flags[-4:] == ["--max-loras", "3", "--max-lora-rank", "4"]
    adapters = dict(module.split("=", 1) for module in flags[1:4])
    assert sorted(adapters) == ["a0", "a1", "a2"]
    config = json.loads((tmp_path / "a_b" / "a2" / "adapter_config.json").read_text())
    assert adapters["a2"] == str(tmp_path / "a_b" / "a2") and config["r"] == 4
    shapes = model_shapes(resolve_model())  # SmolLM2-135M: 30 layers, 9 heads of 64, 3 KV heads, 1536
    assert shapes[(0, "k_proj")] == (192, 576) and shapes[(29, "down_proj")] == (576, 1536)
    assert len(shapes) == 30 * 7
    assert lora_flags(config_from_args(parse_args([])), LaunchSpec("x", ""), tmp_path) == ""


def test_targets():
    assert openai_base_url("http://h:8000") == "http://h:8000/v1"
    assert openai_base_url("http://h:8000/v1/") == "http://h:8000/v1"
    assert parse_compare("no cache = --colocated --disable-radix-cache") == LaunchSpec(
        "no cache", "--colocated --disable-radix-cache"
    )
    before = parse_compare("before@/tmp/old-checkout=--colocated")
    assert before == LaunchSpec("before", "--colocated", "/tmp/old-checkout")
    assert before.python == "/tmp/old-checkout/.venv/bin/python"
    with pytest.raises(ValueError):
        parse_compare("--colocated")


async def test_token_counter_falls_back_to_estimates(closed_url):
    async with await TokenCounter.connect(closed_url, "m") as counter:
        assert counter.source == "estimate"
        assert await counter.count(["one two three.", "Question 12: why?"]) == [4, 6]
        assert await counter.count(["one two"]) == [estimate_tokens("one two")]
        assert await counter.tokens_per_word() == 1.0


def test_refused_requests_are_counted_as_errors(closed_url, capsys):
    argv = ["--base-url", closed_url, "--model", "m", "--concurrency", "1,2", "--num-requests", "3"]
    doc = main([*argv, "--warmup", "0", "--prompt-tokens", "16", "--plot", ""])
    last = json.loads(capsys.readouterr().out.rstrip("\n").split("\n")[-1])
    assert last == doc
    assert last["base_url"] == f"{closed_url}/v1"
    assert [(lv["level"], lv["num_requests"], lv["errors"], lv["completed"]) for lv in last["levels"]] == [
        (1, 3, 3, 0),
        (2, 3, 3, 0),
    ]
    assert "APIConnectionError" in last["levels"][0]["error_samples"][0]
    assert last["runs"][0]["token_counter"] == "estimate"
