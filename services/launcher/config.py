"""Options from a YAML config file, the environment and the command line, in that rising precedence.

``parse_args(parser, argv)`` resolves every option as: command line > ``PDSERVE_<FLAG>`` environment
variable > ``--config FILE`` (or ``PDSERVE_CONFIG``) > the parser's default. The config file is a YAML
mapping whose keys are flag names, with dashes or underscores (``max-total-tokens`` or
``max_total_tokens``); ``true``/``false`` for on/off flags; ``null`` keeps the default.
"""

from __future__ import annotations

import argparse
import difflib
import os
from pathlib import Path
from typing import Any

import yaml

from pdserve.cli_args import apply_env_defaults

CONFIG_ENV = "PDSERVE_CONFIG"


class ConfigError(ValueError):
    """A config file that cannot be used: unreadable, not a mapping, an unknown key or a bad value."""


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Config key (a long flag without its leading ``--``) -> its action; not help or config."""
    return {
        flag.removeprefix("--"): action
        for action in parser._actions
        if action.dest not in ("help", "config")
        for flag in action.option_strings
        if flag.startswith("--")
    }


def _convert(action: argparse.Action, key: str, value: Any) -> Any:
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"{key}: expected a single value, got {value!r}")
    try:
        converted = action.type(str(value)) if action.type else str(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        raise ConfigError(f"{key}: invalid value {value!r} ({e})") from None
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{key}: {value!r} is not one of {choices}")
    return converted


def load_config(parser: argparse.ArgumentParser, path: str | Path) -> dict[str, Any]:
    """Read ``path`` and check it against ``parser``'s options; returns ``{dest: converted value}``.

    Raises:
        ConfigError: the file is unreadable or not YAML, its top level is not a mapping, a key is not
            an option of ``parser`` (the message names it and the closest options), a key appears
            twice (dash and underscore forms), or a value has the wrong type or is not a valid choice.
    """
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of option names to values")
    options = _options(parser)
    values: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("_", "-")
        action = options.get(key)
        if action is None:
            close = difflib.get_close_matches(key, options, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"config file {path}: unknown option {raw_key!r}{hint}")
        if action.dest in seen:
            raise ConfigError(f"config file {path}: {raw_key!r} repeats {seen[action.dest]!r}")
        seen[action.dest] = str(raw_key)
        if value is not None:
            values[action.dest] = _convert(action, f"config file {path}: {raw_key}", value)
    return values


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) with config file, environment and command line.

    ``parser`` must have a ``--config`` option and must not have had ``apply_env_defaults`` applied.
    A bad config file exits through ``parser.error`` (status 2) with the ``ConfigError`` message.
    """
    finder = argparse.ArgumentParser(add_help=False)
    finder.add_argument("--config", default=os.environ.get(CONFIG_ENV))
    path = finder.parse_known_args(argv)[0].config
    if path:
        try:
            config = load_config(parser, path)
        except ConfigError as e:
            parser.error(str(e))
        for action in parser._actions:
            if action.dest in config:
                action.default = config[action.dest]
    apply_env_defaults(parser)
    return parser.parse_args(argv)
