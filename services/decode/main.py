"""``pdserve decode``: the decode-scheduler process (``--colocated``: prefills itself, no prefill pool)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from pdserve.cli_args import (
    apply_env_defaults,
    parse_service_args,
    positive_float,
    positive_int,
    setup_service,
)
from pdserve.distributed import TpGroup
from pdserve.rpc.client_stream import DEFAULT_DEAD_AFTER_S
from pdserve.rpc.server import internal_server, run_service
from pdserve.services.common.bootstrap import build_kv_agent, build_scheduler_off_loop
from pdserve.services.common.drain import drain
from pdserve.services.common.liveness import start_watchdog
from pdserve.services.common.observers import SchedulerObservers
from pdserve.services.common.scheduler_args import add_scheduler_args
from pdserve.services.common.tp_ranks import TpRanks, join_group, supervise
from pdserve.services.decode.prefill_client import DEFAULT_PREFILL_DEAD_AFTER_S
from pdserve.services.decode.servicer import DecodeServicer
from pdserve.v1 import scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve decode", description=__doc__)
    add_scheduler_args(parser, port=30020)
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
    apply_env_defaults(parser)
    return parser


async def build_servicer(args: argparse.Namespace, address: str, tp: TpGroup) -> DecodeServicer:
    """This rank's scheduler (its shard of the model and KV pool), NIXL agent and servicer."""
    role = "mixed" if args.colocated else "decode"
    scheduler = await build_scheduler_off_loop(args, role, tp)
    agent = build_kv_agent(scheduler, role, address, args.host) if role == "decode" else None
    return DecodeServicer(
        scheduler,
        address,
        agent,
        args.prefill_retries,
        args.detokenizer_dead_after,
        args.prefill_dead_after,
        tp,
        overlap=not args.disable_overlap_schedule,
        stream_interval=args.stream_interval,
    )


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    server = internal_server(args, [scheduler_pb2.DESCRIPTOR.services_by_name["DecodeScheduler"].full_name])
    address = f"{args.advertise_host or args.host}:{server.port}"
    ranks = TpRanks(args, "decode", address) if args.tp_size > 1 else None
    tp = await join_group(args, 0, ranks.address if ranks else "")
    servicer = await build_servicer(args, address, tp)
    server.add(scheduler_pb2_grpc.add_DecodeSchedulerServicer_to_server, servicer)
    await server.start()
    loop_stop = asyncio.Event()  # the loop outlives SIGTERM until the drain is over
    supervisor = asyncio.create_task(
        supervise(servicer.loop, loop_stop, ranks, args.tp_watchdog, servicer.fail_all)
    )
    await server.set_serving(True)
    observers = SchedulerObservers(args, servicer.scheduler)
    watchdog = start_watchdog(servicer.loop.heartbeat, server.set_serving, args.watchdog_timeout, stop)
    logger.info("decode-scheduler (%s, TP %d) ready on %s", servicer.scheduler.role, tp.size, address)
    await stop.wait()
    if watchdog is not None:
        await watchdog
    await drain(server, servicer, args.drain_timeout)
    loop_stop.set()
    await server.stop(grace=5.0)
    await supervisor
    await servicer.close()
    await observers.close()
    if servicer.agent is not None:
        servicer.agent.close()  # disconnect peers and deregister the pool before NIXL's threads are torn down
    if ranks is not None:
        ranks.stop()


def main(argv: list[str] | None = None) -> None:
    args = parse_service_args(make_parser(), argv)
    setup_service(args, "decode")
    run_service(lambda stop: serve(args, stop))


if __name__ == "__main__":
    main()
