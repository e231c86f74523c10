"""Tokenizer service entry point: ``python -m pdserve.services.tokenizer.main --model M --port P``."""

from __future__ import annotations

import argparse
import asyncio

from prometheus_client import REGISTRY

from pdserve.cli_args import add_chat_template_arg
from pdserve.model_source import served_model_names
from pdserve.observability.metrics_http import labelled
from pdserve.rpc.server import GrpcServer
from pdserve.services.common import service_entry
from pdserve.services.tokenizer.servicer import SERVICE_NAME, TokenizerServicer, add_to_server
from pdserve.tokenization import Tokenizer

DEFAULT_PORT = 30001


def build_parser() -> argparse.ArgumentParser:
    """Flags; each defaults to env PDSERVE_<FLAG> when set."""
    return service_entry.build_parser("pdserve tokenizer", __doc__, DEFAULT_PORT, add_chat_template_arg)


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
    servicer = TokenizerServicer(tokenizer)
    server, _ = await service_entry.start_server(args, SERVICE_NAME, add_to_server, lambda _address: servicer)
    return server


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    server = await start_server(args)
    model_name = served_model_names(args.model, args.served_model_name)[0]
    await service_entry.serve_until(stop, args, server, labelled(REGISTRY, model_name=model_name))


def main(argv: list[str] | None = None) -> None:
    service_entry.run("tokenizer", build_parser(), serve, argv)


if __name__ == "__main__":
    main()
