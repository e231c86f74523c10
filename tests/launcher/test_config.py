"""``pdserve launch`` options: YAML config file, PDSERVE_<FLAG> environment and command line, and --help."""

from __future__ import annotations

import os

import pytest

from pdserve.services.launcher import config
from pdserve.services.launcher.main import make_parser, parse_args


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No PDSERVE_* variable of the developer's shell leaks into these tests."""
    for name in list(os.environ):
        if name.startswith("PDSERVE_"):
            monkeypatch.delenv(name)


@pytest.fixture
def config_file(tmp_path):
    def write(text: str):
        path = tmp_path / "launch.yaml"
        path.write_text(text)
        return str(path)

    return write


def test_config_keys_with_dashes_or_underscores_and_typed_values(config_file) -> None:
    path = config_file(
        "num-decode: 3\nmax_total_tokens: 16384\ncolocated: true\ndtype: float32\n"
        "drain-timeout: 7.5\nserved_model_name: tiny\nkv-cache-memory: null\n"
    )
    args = parse_args(["--config", path])
    assert args.num_decode == 3 and isinstance(args.num_decode, int)
    assert args.max_total_tokens == 16384
    assert args.colocated is True
    assert args.dtype == "float32"
    assert args.drain_timeout == 7.5
    assert args.served_model_name == "tiny"
    assert args.kv_cache_memory is None  # null keeps the default
    defaults = make_parser().parse_args([])
    assert (args.port, args.page_size, args.router_policy) == (
        defaults.port,
        defaults.page_size,
        defaults.router_policy,
    )


def test_precedence_command_line_then_env_then_config_then_default(config_file, monkeypatch) -> None:
    path = config_file("num_decode: 3\nport: 9001\nrouter-policy: least_load\ndtype: bfloat16\n")
    monkeypatch.setenv("PDSERVE_PORT", "9002")
    monkeypatch.setenv("PDSERVE_ROUTER_POLICY", "round_robin")
    monkeypatch.setenv("PDSERVE_COLOCATED", "1")
    args = parse_args(["--config", path, "--router-policy", "cache_aware"])
    assert args.router_policy == "cache_aware"  # command line beats environment and config
    assert args.port == 9002  # environment beats config
    assert args.num_decode == 3 and args.dtype == "bfloat16"  # config beats defaults
    assert args.colocated is True  # environment, no config entry
    assert args.page_size == make_parser().get_default("page_size")  # default


def test_config_path_from_environment(config_file, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_CONFIG", config_file("num-prefill: 2\n"))
    assert parse_args([]).num_prefill == 2
    assert parse_args(["--num-prefill", "4"]).num_prefill == 4


def test_unknown_key_is_a_clear_error(config_file, capsys) -> None:
    path = config_file("num-decode: 2\nmax-total-token: 100\n")
    with pytest.raises(config.ConfigError, match=r"unknown option 'max-total-token'.*max-total-tokens"):
        config.load_config(make_parser(), path)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--config", path])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown option 'max-total-token'" in err and path in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("num-decode: two\n", "num-decode: invalid value 'two'"),
        ("page_size: 0\n", "page_size: invalid value 0 .must be a positive integer, got 0."),
        ("device: tpu\n", "device: invalid value 'tpu' .expected auto, cpu, cuda or cuda:<index>"),
        ("dtype: float16\n", "'float16' is not one of auto, float32, bfloat16"),
        ("colocated: 1\n", "colocated: expected true or false"),
        ("port: [1, 2]\n", "port: expected a single value"),
        ("api-key: true\n", "api-key: expected a single value"),
        ("num-decode: 2\nnum_decode: 3\n", "'num_decode' repeats 'num-decode'"),
        ("config: other.yaml\n", "unknown option 'config'"),
        ("- num-decode\n", "expected a mapping"),
        ("port: [1\n", "cannot read config file"),
    ],
)
def test_bad_config_values(config_file, text: str, message: str) -> None:
    with pytest.raises(config.ConfigError, match=message.replace("[", r"\[")):
        config.load_config(make_parser(), config_file(text))


def test_empty_config_and_missing_file(config_file, tmp_path) -> None:
    assert config.load_config(make_parser(), config_file("")) == {}
    with pytest.raises(config.ConfigError, match="cannot read config file"):
        config.load_config(make_parser(), tmp_path / "absent.yaml")


def test_impossible_topologies_are_rejected(capsys) -> None:
    for argv, message in [
        (["--num-decode", "0"], "--num-decode must be at least 1"),
        (["--num-prefill", "0"], "--num-prefill must be at least 1"),
        (["--drain-timeout", "-1"], "--drain-timeout must not be negative"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
    assert parse_args(["--num-prefill", "0", "--colocated"]).colocated


def test_bad_engine_flags_fail_before_anything_starts(capsys, monkeypatch) -> None:
    """Checked by the launcher's parser, not seconds later in a scheduler's traceback."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible
    for argv, message in [
        (["--page-size", "0"], "--page-size: must be a positive integer, got 0"),
        (["--max-total-tokens", "-4"], "--max-total-tokens: must be a positive integer, got -4"),
        (["--kv-memory-fraction", "1.5"], "--kv-memory-fraction: must be in (0, 1], got 1.5"),
        (["--swa-full-tokens-ratio", "0"], "--swa-full-tokens-ratio: must be in (0, 1], got 0"),
        (["--kv-tier-memory", "lots"], "--kv-tier-memory: not a size in bytes (e.g. 8GiB): lots"),
        (["--kv-tier-memory", "-1"], "--kv-tier-memory: not a size in bytes"),
        (["--kv-tier-memory", "2PiB"], "--kv-tier-memory: must be in [0, 1125899906842624] bytes"),
        (["--colocated", "--kv-tier-memory", "1GiB", "--swa-full-tokens-ratio", "1"], "cannot be combined"),
        (["--device", "tpu"], "expected auto, cpu, cuda or cuda:<index>, got 'tpu'"),
        (["--device", "cuda"], "--device cuda needs a CUDA GPU and none is visible"),
        (["--device", "cuda:1"], "--device cuda:1 needs a CUDA GPU and none is visible"),
        (["--attention-backend", "flashinfer"], "--attention-backend flashinfer needs a CUDA GPU"),
        (["--attention-backend", "flashinfer", "--device", "cpu"], "flashinfer runs on CUDA only"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert parse_args(["--device", "cuda:0", "--attention-backend", "flashinfer"]).device == "cuda:0"


def test_bad_environment_values_are_clear_errors(capsys, monkeypatch) -> None:
    for name, raw, message in [
        ("PDSERVE_PAGE_SIZE", "0", "PDSERVE_PAGE_SIZE='0': must be a positive integer, got 0"),
        ("PDSERVE_NUM_DECODE", "two", "PDSERVE_NUM_DECODE='two': invalid literal for int()"),
        ("PDSERVE_DEVICE", "tpu", "PDSERVE_DEVICE='tpu': expected auto, cpu, cuda or cuda:<index>"),
        ("PDSERVE_COLOCATED", "maybe", "PDSERVE_COLOCATED='maybe': expected 1/true/yes/on or 0/false/no/off"),
        ("PDSERVE_DTYPE", "fp8", "PDSERVE_DTYPE='fp8': expected one of auto, float32, bfloat16"),
    ]:
        monkeypatch.setenv(name, raw)
        with pytest.raises(SystemExit):
            parse_args([])
        assert message in capsys.readouterr().err
        monkeypatch.delenv(name)
    monkeypatch.setenv("PDSERVE_COLOCATED", "off")
    assert not parse_args([]).colocated


def test_help_documents_every_option(capsys) -> None:
    parser = make_parser()
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    squeezed = "".join(capsys.readouterr().out.split())  # help lines wrap anywhere, even at hyphens
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"
        assert action.option_strings[-1] in squeezed
        assert "".join(action.help.split()) in squeezed
    assert "PDSERVE_" in squeezed and "commandline>environment>configfile>defaults" in squeezed
