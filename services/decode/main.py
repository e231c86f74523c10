"""``pdserve decode``: the decode-scheduler role (``--colocated``: prefills itself, no prefill pool)."""

from __future__ import annotations

import argparse

from pdserve.cli_args import positive_float, positive_int
from pdserve.distributed import TpGroup
from pdserve.rpc.client_stream import DEFAULT_DEAD_AFTER_S
from pdserve.services.common.bootstrap import (
    build_kv_agent,
    build_scheduler_off_loop,
    forward_lock,
    overlap_schedule,
)
from pdserve.services.common.scheduler_main import SchedulerRole
from pdserve.services.decode import servicer
from pdserve.services.decode.prefill_client import DEFAULT_PREFILL_DEAD_AFTER_S


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="prefill locally (mixed role) instead of using prefill workers",
    )
    parser.add_argument(
        "--prefill-retries", type=int, default=1, help="other prefill workers to retry a failed prefill on"
    )
    parser.add_argument(
        "--detokenizer-dead-after",
        type=float,
        default=DEFAULT_DEAD_AFTER_S,
        help="seconds a detokenizer may stay unreachable before the requests it serves are aborted",
    )
    parser.add_argument(
        "--prefill-dead-after",
        type=positive_float,
        default=DEFAULT_PREFILL_DEAD_AFTER_S,
        help="seconds a prefill worker may leave its health checks unanswered before the prefills it "
        "holds are retried on another one",
    )
    parser.add_argument(
        "--stream-interval",
        type=positive_int,
        default=1,
        help="tokens per streamed output of a request (its first and last go out at once)",
    )


async def build_servicer(args: argparse.Namespace, address: str, tp: TpGroup) -> servicer.DecodeServicer:
    """This rank's scheduler (its shard of the model and KV pool), NIXL agent and servicer."""
    role = "mixed" if args.colocated else "decode"
    scheduler = await build_scheduler_off_loop(args, role, tp)
    agent = build_kv_agent(scheduler, role, address, args.host) if role == "decode" else None
    return servicer.DecodeServicer(
        scheduler,
        address,
        agent,
        args.prefill_retries,
        args.detokenizer_dead_after,
        args.prefill_dead_after,
        tp,
        overlap=overlap_schedule(args, scheduler.runner.device),
        forward_lock=forward_lock(args),
        stream_interval=args.stream_interval,
    )


ROLE = SchedulerRole(
    "decode", 30020, __doc__, add_args, build_servicer, servicer.SERVICE, servicer.add_to_server
)
make_parser, main = ROLE.make_parser, ROLE.main  # (``pdserve.cli`` runs ``main``)
