"""The scheduler process, one entry for both roles: ``pdserve prefill`` and ``pdserve decode``.

A role (``SchedulerRole``, declared by ``services/prefill/main.py`` and ``services/decode/main.py``)
names its flags, its gRPC service and how its servicer is built. Everything else is the same for
both and is here: the internal gRPC server, the TP rank group, the scheduler loop under its
supervisor, the operators' observers and step watchdog, the drain on SIGTERM and the shutdown order.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pdserve.cli_args import (
    add_engine_args,
    add_model_arg,
    add_server_args,
    apply_env_defaults,
    check_lora_flags,
    parse_service_args,
    setup_service,
)
from pdserve.distributed import TpGroup
from pdserve.observability.stats_log import add_stats_args
from pdserve.rpc.server import internal_server, run_service
from pdserve.services.common.drain import add_drain_args, drain
from pdserve.services.common.kv_events_zmq import ZmqKVEventPublisher
from pdserve.services.common.kv_events_zmq_args import add_kv_events_args
from pdserve.services.common.liveness import start_watchdog
from pdserve.services.common.observers import SchedulerObservers
from pdserve.services.common.tp_ranks import TpRanks, join_group, supervise

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerRole:
    """What one scheduler role brings to the shared entry.

    Attributes:
        name: ``prefill`` or ``decode`` (the CLI command; names its logs, metrics and TP ranks).
        port: the default gRPC port.
        description: the command's help.
        add_args: adds the role's own flags to the parser.
        build_servicer: ``await build_servicer(args, address, tp)``: this rank's scheduler, NIXL agent
            and servicer (a module-level function: TP ranks, started with ``spawn``, get it by name).
        service: the full gRPC service name (health and reflection).
        add_to_server: the generated ``add_..._to_server`` of the servicer.
    """

    name: str
    port: int
    description: str
    add_args: Callable[[argparse.ArgumentParser], None]
    build_servicer: Callable[[argparse.Namespace, str, TpGroup], Awaitable[Any]]
    service: str
    add_to_server: Callable[[Any, Any], None]

    def make_parser(self) -> argparse.ArgumentParser:
        return make_parser(self)

    def main(self, argv: list[str] | None = None) -> None:
        """``pdserve <name> [flags]``."""
        parser = make_parser(self)
        args = parse_service_args(parser, argv)
        check_lora_flags(parser, args)
        setup_service(args, self.name)
        run_service(lambda stop: serve(self, args, stop))


def make_parser(role: SchedulerRole) -> argparse.ArgumentParser:
    """The role's flags: engine and scheduling flags shared by both roles, then its own."""
    parser = argparse.ArgumentParser(prog=f"pdserve {role.name}", description=role.description)
    add_server_args(parser, role.port)
    add_model_arg(parser)
    add_engine_args(parser)
    add_stats_args(parser)
    add_drain_args(parser)
    add_kv_events_args(parser)
    parser.add_argument("--worker-id", default=None, help="name in metrics and logs (default: host:port)")
    parser.add_argument(
        "--tp-watchdog",
        type=float,
        default=10.0,
        help="seconds a TP rank may stay an iteration behind rank 0 before the group counts as hung",
    )
    parser.add_argument(
        "--forward-lock",
        default=None,
        metavar="PATH",
        help="a lock file shared by the schedulers on this machine's cores: their forwards take turns "
        "(pdserve launch gives one on a CPU)",
    )
    role.add_args(parser)
    apply_env_defaults(parser)
    return parser


def kv_events_zmq(args: argparse.Namespace) -> ZmqKVEventPublisher | None:
    """The ZMQ publisher of ``--kv-events-endpoint`` (None without it).

    Raises:
        SystemExit: an endpoint ZMQ refuses (a clear start-up error).
    """
    if not args.kv_events_endpoint:
        if args.kv_events_replay_endpoint:
            raise SystemExit("pdserve: --kv-events-replay-endpoint needs --kv-events-endpoint")
        return None
    try:
        return ZmqKVEventPublisher(
            args.kv_events_endpoint, args.kv_events_replay_endpoint, args.kv_events_topic
        )
    except ValueError as e:
        raise SystemExit(f"pdserve: {e}") from e


async def serve(role: SchedulerRole, args: argparse.Namespace, stop: asyncio.Event) -> None:
    """Serve until ``stop`` (SIGTERM), then drain and shut down in order."""
    zmq_events = kv_events_zmq(args)  # first: a bad endpoint fails before the model loads
    server = internal_server(args, [role.service])
    address = f"{args.advertise_host or args.host}:{server.port}"
    ranks = TpRanks(args, role.name, role.build_servicer, address) if args.tp_size > 1 else None
    tp = await join_group(args, 0, ranks.address if ranks else "")
    servicer = await role.build_servicer(args, address, tp)
    if zmq_events is not None and servicer.loop.kv_events is not None:
        servicer.loop.kv_events.listeners.append(zmq_events.publish)
    server.add(role.add_to_server, servicer)
    await server.start()
    loop_stop = asyncio.Event()  # the loop outlives SIGTERM until the drain is over
    supervisor = asyncio.create_task(
        supervise(servicer.loop, loop_stop, ranks, args.tp_watchdog, servicer.fail_all)
    )
    await server.set_serving(True)
    observers = SchedulerObservers(args, servicer.scheduler)
    watchdog = start_watchdog(servicer.loop.heartbeat, server.set_serving, args.watchdog_timeout, stop)
    logger.info("%s-scheduler (%s, TP %d) ready on %s", role.name, servicer.scheduler.role, tp.size, address)
    await stop.wait()
    if watchdog is not None:
        await watchdog
    await drain(server, servicer, args.drain_timeout)
    loop_stop.set()
    await server.stop(grace=5.0)
    await supervisor
    if zmq_events is not None:
        zmq_events.close()
    await servicer.close()
    await observers.close()
    if servicer.agent is not None:
        servicer.agent.close()  # disconnect peers and deregister the pool before NIXL's threads are torn down
    if ranks is not None:
        ranks.stop()
