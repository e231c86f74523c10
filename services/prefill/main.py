"""``pdserve prefill``: the prefill-scheduler process (writes KV into decode workers over NIXL)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from pdserve.cli_args import apply_env_defaults, parse_service_args, setup_logging
from pdserve.rpc.server import internal_server, run_service
from pdserve.services.common.bootstrap import build_kv_agent, build_scheduler_off_loop
from pdserve.services.common.liveness import start_watchdog
from pdserve.services.common.scheduler_args import add_scheduler_args
from pdserve.services.prefill.servicer import PrefillServicer
from pdserve.v1 import scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve prefill", description=__doc__)
    add_scheduler_args(parser, port=30010)
    parser.add_argument(
        "--kv-stream-chunks",
        default="on",
        choices=["on", "off"],
        help="send a chunked prompt's finished pages while later chunks compute (off: all at the end)",
    )
    apply_env_defaults(parser)
    return parser


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    service = scheduler_pb2.DESCRIPTOR.services_by_name["PrefillScheduler"].full_name
    server = internal_server(args, [service])
    address = f"{args.advertise_host or args.host}:{server.port}"
    scheduler = await build_scheduler_off_loop(args, "prefill")
    agent = build_kv_agent(scheduler, "prefill", address, args.host)
    servicer = PrefillServicer(
        scheduler,
        address,
        agent,
        stream_chunks=args.kv_stream_chunks == "on",
        overlap=not args.disable_overlap_schedule,
    )
    server.add(scheduler_pb2_grpc.add_PrefillSchedulerServicer_to_server, servicer)
    await server.start()
    loop_task = asyncio.create_task(servicer.loop.run(stop))
    await server.set_serving(True)
    watchdog = start_watchdog(servicer.loop.heartbeat, server.set_serving, args.watchdog_timeout, stop)
    logger.info("prefill-scheduler ready on %s", address)
    await stop.wait()
    if watchdog is not None:
        await watchdog
    await server.stop(grace=5.0)
    await loop_task
    servicer.agent.close()  # disconnect peers and deregister the pool before NIXL's threads are torn down


def main(argv: list[str] | None = None) -> None:
    args = parse_service_args(make_parser(), argv)
    setup_logging(args.log_level, "prefill")
    run_service(lambda stop: serve(args, stop))


if __name__ == "__main__":
    main()
