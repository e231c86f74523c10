"""The entry scaffolding of a service that runs one internal gRPC server (the tokenizer and the
detokenizer): its flags, its server started and reporting SERVING, its metrics, a graceful stop.

Each entry keeps what is its own (its flags, what it loads, its servicer, its metrics registry) and
hands the rest to ``build_parser``, ``start_server``, ``serve_until`` and ``run``.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from prometheus_client import CollectorRegistry

from pdserve.cli_args import (
    add_model_arg,
    add_server_args,
    apply_env_defaults,
    parse_service_args,
    setup_service,
)
from pdserve.observability.metrics_http import serve_metrics
from pdserve.rpc.server import GrpcServer, internal_server, run_service

Servicer = TypeVar("Servicer")


def build_parser(
    prog: str, description: str | None, port: int, add_flags: Callable[[argparse.ArgumentParser], None]
) -> argparse.ArgumentParser:
    """``--model`` and its companions, the internal server's flags (default port ``port``), then the
    service's own (``add_flags``); each flag defaults to env ``PDSERVE_<FLAG>`` when set."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_model_arg(parser)
    add_server_args(parser, port)
    add_flags(parser)
    apply_env_defaults(parser)
    return parser


async def start_server(
    args: argparse.Namespace,
    service_name: str,
    add_to_server: Callable[[Servicer, object], None],
    make_servicer: Callable[[str], Servicer],
) -> tuple[GrpcServer, Servicer]:
    """The internal gRPC server of ``args`` (``--host:--port``, TLS) serving ``service_name`` with the
    servicer ``make_servicer(server address)``, started and reporting SERVING; the caller stops it.

    Raises:
        OSError: the port cannot be bound.
    """
    server = internal_server(args, [service_name])
    servicer = make_servicer(server.address)
    server.add(add_to_server, servicer)
    await server.start()
    await server.set_serving(True)
    return server, servicer


async def serve_until(
    stop: asyncio.Event,
    args: argparse.Namespace,
    server: GrpcServer,
    metrics: CollectorRegistry,
    close: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serve ``metrics`` on ``--metrics-port`` (when given) until ``stop`` is set; then stop the server,
    await ``close`` (the servicer's own cleanup) and close the metrics endpoint."""
    endpoint = serve_metrics(args, args.host, metrics)
    await stop.wait()
    await server.stop()
    if close is not None:
        await close()
    if endpoint is not None:
        endpoint.close()


def run(
    service: str,
    parser: argparse.ArgumentParser,
    serve: Callable[[argparse.Namespace, asyncio.Event], Awaitable[None]],
    argv: list[str] | None,
) -> None:
    """Parse ``argv`` (TLS identity included), set up logging and tracing for ``service``, and run
    ``serve(args, stop)`` on uvloop until SIGINT or SIGTERM sets ``stop``."""
    args = parse_service_args(parser, argv)
    setup_service(args, service)
    run_service(lambda stop: serve(args, stop))
