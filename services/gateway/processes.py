"""``pdserve gateway --workers N``: N gateway processes on one HTTP port and one public gRPC port.

Each worker is a whole gateway (its own request manager, router and connections) that binds the
shared public ports with SO_REUSEPORT, so the kernel spreads client connections over the workers
(vLLM's ``--api-server-count``), and takes the outputs of the requests it owns on its own internal
server (GatewayOutput, on ``--internal-host``, mutual TLS with ``--tls-*``), port
``--internal-grpc-port + i``, which it advertises to the detokenizers with every request. This
process only supervises them, with the ``Supervisor`` of ``pdserve launch`` (health: each worker's
internal server, SERVING once the worker's HTTP side listens): it restarts a worker that dies, and
on SIGTERM drains every worker as a single gateway would drain.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from pdserve.rpc import tls
from pdserve.services.common.supervision.console import Console
from pdserve.services.common.supervision.spec import ServiceSpec
from pdserve.services.common.supervision.supervisor import Supervisor

logger = logging.getLogger("pdserve.gateway")

_STARTUP_TIMEOUT_S = 120.0


def worker_specs(args: argparse.Namespace, argv: list[str]) -> list[ServiceSpec]:
    """The ``args.workers`` worker processes: ``argv`` plus each one's flags (later flags win)."""
    probe_host = "127.0.0.1" if args.internal_host in ("0.0.0.0", "") else args.internal_host
    specs = []
    for i in range(args.workers):
        port = args.internal_grpc_port + i
        flags = ["--workers", "1", "--reuse-port", "--internal-grpc-port", str(port)]
        if args.metrics_port is not None:  # each worker's own registry on a port of its own
            flags += ["--metrics-port", str(args.metrics_port + i)]
        specs.append(ServiceSpec(f"gateway-{i}", "gateway", [*argv, *flags], f"{probe_host}:{port}"))
    return specs


async def serve_workers(args: argparse.Namespace, argv: list[str], stop: asyncio.Event) -> None:
    """Start every worker, keep them running until ``stop`` is set, then drain and stop them.

    Raises SystemExit(1) if a worker fails to start.
    """
    tls.configure(args.identity)  # the workers' health checks speak mutual TLS to their internal servers
    supervisor = Supervisor(
        worker_specs(args, argv),
        Console(json_lines=args.log_format == "json"),
        startup_timeout=_STARTUP_TIMEOUT_S,
        drain_timeout=args.drain_timeout,
    )
    try:
        try:
            await supervisor.start_all()
        except RuntimeError as e:
            logger.error("gateway workers failed to start: %s", e)
            raise SystemExit(1) from None
        logger.info("%d gateway workers up on port %d", args.workers, args.port)
        await supervisor.supervise(stop)
    finally:
        await supervisor.stop_all()
