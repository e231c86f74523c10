"""``pdserve prefill``: the prefill-scheduler role (writes KV into decode workers over NIXL)."""

from __future__ import annotations

import argparse

from pdserve.distributed import TpGroup
from pdserve.services.common.bootstrap import (
    build_kv_agent,
    build_scheduler_off_loop,
    forward_lock,
    gather_agents,
    overlap_schedule,
)
from pdserve.services.common.scheduler_main import SchedulerRole
from pdserve.services.prefill import servicer


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-stream-chunks",
        default="on",
        choices=["on", "off"],
        help="send a chunked prompt's finished pages while later chunks compute (off: all at the end)",
    )


async def build_servicer(args: argparse.Namespace, address: str, tp: TpGroup) -> servicer.PrefillServicer:
    """This rank's scheduler (its shard of the model and KV pool), NIXL agent and servicer."""
    scheduler = await build_scheduler_off_loop(args, "prefill", tp)
    agent = build_kv_agent(scheduler, "prefill", address, args.host)
    rank_agents = await gather_agents(agent, tp)
    return servicer.PrefillServicer(
        scheduler,
        address,
        agent,
        args.kv_stream_chunks == "on",
        overlap=overlap_schedule(args, scheduler.runner.device),
        forward_lock=forward_lock(args),
        tp=tp,
        rank_agents=rank_agents,
    )


ROLE = SchedulerRole(
    "prefill", 30010, __doc__, add_args, build_servicer, servicer.SERVICE, servicer.add_to_server
)
make_parser, main = ROLE.make_parser, ROLE.main  # (``pdserve.cli`` runs ``main``)
