"""Detokenizer service entry point: ``python -m pdserve.services.detokenizer.main --model M --port P``."""

from __future__ import annotations

import argparse
import asyncio

from prometheus_client import REGISTRY

from pdserve.cli_args import (
    add_model_arg,
    add_server_args,
    apply_env_defaults,
    parse_service_args,
    setup_service,
)
from pdserve.detokenize import IncrementalDetokenizer
from pdserve.model_source import served_model_names
from pdserve.observability.metrics_http import labelled, serve_metrics
from pdserve.rpc.client_stream import DEFAULT_DEAD_AFTER_S
from pdserve.rpc.server import GrpcServer, internal_server, run_service
from pdserve.services.detokenizer.servicer import SERVICE_NAME, DetokenizerServicer
from pdserve.tokenization import Tokenizer
from pdserve.v1 import output_pb2_grpc

DEFAULT_PORT = 30002


def build_parser() -> argparse.ArgumentParser:
    """Flags; each defaults to env PDSERVE_<FLAG> when set."""
    parser = argparse.ArgumentParser(prog="pdserve detokenizer", description=__doc__)
    add_model_arg(parser)
    add_server_args(parser, DEFAULT_PORT)
    parser.add_argument(
        "--gateway-dead-after",
        type=float,
        default=DEFAULT_DEAD_AFTER_S,
        help="seconds a gateway may stay unreachable before its requests are aborted",
    )
    apply_env_defaults(parser)
    return parser


async def start_server(args: argparse.Namespace) -> tuple[GrpcServer, DetokenizerServicer]:
    """Load the tokenizer, then start the gRPC server and report SERVING; the caller stops both."""
    tokenizer = await asyncio.to_thread(Tokenizer.load, args.model, revision=args.revision)
    server = internal_server(args, [SERVICE_NAME])
    servicer = DetokenizerServicer(
        IncrementalDetokenizer(tokenizer),
        worker=server.address,
        gateway_dead_after=args.gateway_dead_after,
        model_name=served_model_names(args.model, args.served_model_name)[0],
    )
    server.add(output_pb2_grpc.add_DetokenizerServicer_to_server, servicer)
    await server.start()
    await server.set_serving(True)
    return server, servicer


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    server, servicer = await start_server(args)
    exposed = labelled(servicer.metrics.registry, REGISTRY, model_name=servicer.metrics.model_name)
    metrics = serve_metrics(args, args.host, exposed)
    await stop.wait()
    await server.stop()
    await servicer.close()
    if metrics is not None:
        metrics.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_service_args(build_parser(), argv)
    setup_service(args, "detokenizer")
    run_service(lambda stop: serve(args, stop))


if __name__ == "__main__":
    main()
