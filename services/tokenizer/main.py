"""Tokenizer service entry point: ``python -m pdserve.services.tokenizer.main --model M --port P``."""

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
from pdserve.model_source import served_model_names
from pdserve.observability.metrics_http import labelled, serve_metrics
from pdserve.rpc.server import GrpcServer, internal_server, run_service
from pdserve.services.tokenizer.servicer import SERVICE_NAME, TokenizerServicer
from pdserve.tokenization import Tokenizer
from pdserve.v1 import tokenizer_pb2_grpc

DEFAULT_PORT = 30001


def build_parser() -> argparse.ArgumentParser:
    """Flags; each defaults to env PDSERVE_<FLAG> when set."""
    parser = argparse.ArgumentParser(prog="pdserve tokenizer", description=__doc__)
    add_model_arg(parser)
    add_server_args(parser, DEFAULT_PORT)
    parser.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file, or the template itself, instead of the model's own",
    )
    apply_env_defaults(parser)
    return parser


async def start_server(args: argparse.Namespace) -> GrpcServer:
    """Load the tokenizer, then start the gRPC server and report SERVING; the caller stops it.

    Raises:
        ValueError: a bad ``--chat-template`` or ``--max-model-len``.
    """
    tokenizer = await asyncio.to_thread(
        Tokenizer.load,
        args.model,
        revision=args.revision,
        model_name=served_model_names(args.model, args.served_model_name)[0],
        chat_template=args.chat_template,
        max_model_len=args.max_model_len,
    )
    server = internal_server(args, [SERVICE_NAME])
    server.add(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, TokenizerServicer(tokenizer))
    await server.start()
    await server.set_serving(True)
    return server


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    server = await start_server(args)
    model_name = served_model_names(args.model, args.served_model_name)[0]
    metrics = serve_metrics(args, args.host, labelled(REGISTRY, model_name=model_name))
    await stop.wait()
    await server.stop()
    if metrics is not None:
        metrics.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_service_args(build_parser(), argv)
    setup_service(args, "tokenizer")
    run_service(lambda stop: serve(args, stop))


if __name__ == "__main__":
    main()
