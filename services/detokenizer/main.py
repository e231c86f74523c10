"""Detokenizer service entry point: ``python -m pdserve.services.detokenizer.main --model M --port P``."""

from __future__ import annotations

import argparse
import asyncio

from prometheus_client import REGISTRY

from pdserve.detokenize import IncrementalDetokenizer
from pdserve.model_source import served_model_names
from pdserve.observability.metrics_http import labelled
from pdserve.rpc.client_stream import DEFAULT_DEAD_AFTER_S
from pdserve.rpc.server import GrpcServer
from pdserve.services.common import service_entry
from pdserve.services.detokenizer.servicer import SERVICE_NAME, DetokenizerServicer, add_to_server
from pdserve.tokenization import Tokenizer

DEFAULT_PORT = 30002


def build_parser() -> argparse.ArgumentParser:
    """Flags; each defaults to env PDSERVE_<FLAG> when set."""
    return service_entry.build_parser("pdserve detokenizer", __doc__, DEFAULT_PORT, _add_flags)


def _add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gateway-dead-after",
        type=float,
        default=DEFAULT_DEAD_AFTER_S,
        help="seconds a gateway may stay unreachable before its requests are aborted",
    )


async def start_server(args: argparse.Namespace) -> tuple[GrpcServer, DetokenizerServicer]:
    """Load the tokenizer, then start the gRPC server and report SERVING; the caller stops both."""
    tokenizer = await asyncio.to_thread(Tokenizer.load, args.model, revision=args.revision)

    def servicer(address: str) -> DetokenizerServicer:
        return DetokenizerServicer(
            IncrementalDetokenizer(tokenizer),
            worker=address,
            gateway_dead_after=args.gateway_dead_after,
            model_name=served_model_names(args.model, args.served_model_name)[0],
        )

    return await service_entry.start_server(args, SERVICE_NAME, add_to_server, servicer)


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    server, servicer = await start_server(args)
    exposed = labelled(servicer.metrics.registry, REGISTRY, model_name=servicer.metrics.model_name)
    await service_entry.serve_until(stop, args, server, exposed, close=servicer.close)


def main(argv: list[str] | None = None) -> None:
    service_entry.run("detokenizer", build_parser(), serve, argv)


if __name__ == "__main__":
    main()
