"""``pdserve prefill``: the prefill-scheduler process (writes KV into decode workers over NIXL)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from pdserve.cli_args import apply_env_defaults, parse_service_args, setup_service
from pdserve.distributed import TpGroup
from pdserve.rpc.server import internal_server, run_service
from pdserve.services.common.bootstrap import build_kv_agent, build_scheduler_off_loop, gather_agents
from pdserve.services.common.drain import drain
from pdserve.services.common.liveness import start_watchdog
from pdserve.services.common.observers import SchedulerObservers
from pdserve.services.common.scheduler_args import add_scheduler_args
from pdserve.services.common.tp_ranks import TpRanks, join_group, supervise
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


async def build_servicer(args: argparse.Namespace, address: str, tp: TpGroup) -> PrefillServicer:
    """This rank's scheduler (its shard of the model and KV pool), NIXL agent and servicer."""
    scheduler = await build_scheduler_off_loop(args, "prefill", tp)
    agent = build_kv_agent(scheduler, "prefill", address, args.host)
    stream_chunks = args.kv_stream_chunks == "on"
    rank_agents = await gather_agents(agent, tp)
    return PrefillServicer(
        scheduler,
        address,
        agent,
        stream_chunks,
        overlap=not args.disable_overlap_schedule,
        tp=tp,
        rank_agents=rank_agents,
    )


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    service = scheduler_pb2.DESCRIPTOR.services_by_name["PrefillScheduler"].full_name
    server = internal_server(args, [service])
    address = f"{args.advertise_host or args.host}:{server.port}"
    ranks = TpRanks(args, "prefill", address) if args.tp_size > 1 else None
    tp = await join_group(args, 0, ranks.address if ranks else "")
    servicer = await build_servicer(args, address, tp)
    server.add(scheduler_pb2_grpc.add_PrefillSchedulerServicer_to_server, servicer)
    await server.start()
    loop_stop = asyncio.Event()  # the loop outlives SIGTERM until the drain is over
    supervisor = asyncio.create_task(
        supervise(servicer.loop, loop_stop, ranks, args.tp_watchdog, servicer.fail_all)
    )
    await server.set_serving(True)
    observers = SchedulerObservers(args, servicer.scheduler)
    watchdog = start_watchdog(servicer.loop.heartbeat, server.set_serving, args.watchdog_timeout, stop)
    logger.info("prefill-scheduler (TP %d) ready on %s", tp.size, address)
    await stop.wait()
    if watchdog is not None:
        await watchdog
    await drain(server, servicer, args.drain_timeout)
    loop_stop.set()
    await server.stop(grace=5.0)
    await supervisor
    await observers.close()
    servicer.agent.close()  # disconnect peers and deregister the pool before NIXL's threads are torn down
    if ranks is not None:
        ranks.stop()


def main(argv: list[str] | None = None) -> None:
    args = parse_service_args(make_parser(), argv)
    setup_service(args, "prefill")
    run_service(lambda stop: serve(args, stop))


if __name__ == "__main__":
    main()
