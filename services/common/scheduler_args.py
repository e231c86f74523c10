"""Engine and scheduling flags shared by ``pdserve prefill`` and ``pdserve decode``."""

from __future__ import annotations

import argparse

from pdserve.cli_args import add_engine_args, add_model_arg, add_server_args
from pdserve.observability.stats_log import add_stats_args
from pdserve.services.common.drain import add_drain_args


def add_scheduler_args(parser: argparse.ArgumentParser, port: int) -> None:
    add_server_args(parser, port)
    add_model_arg(parser)
    add_engine_args(parser)
    add_stats_args(parser)
    add_drain_args(parser)
    parser.add_argument("--worker-id", default=None, help="name in metrics and logs (default: host:port)")
    parser.add_argument(
        "--tp-watchdog",
        type=float,
        default=10.0,
        help="seconds a TP rank may stay an iteration behind rank 0 before the group counts as hung",
    )
