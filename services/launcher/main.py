"""``pdserve launch``: a whole pdserve topology on one machine, supervised in the foreground."""

from __future__ import annotations

import argparse
import asyncio
import logging

from pdserve.cli_args import add_model_arg, apply_env_defaults, setup_logging
from pdserve.model_source import resolve_model
from pdserve.rpc.server import run_service
from pdserve.services.launcher.supervisor import Supervisor
from pdserve.services.launcher.topology import build_topology

logger = logging.getLogger("pdserve.launch")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve launch", description=__doc__)
    add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="gateway HTTP/gRPC bind address")
    p.add_argument("--port", type=int, default=8000, help="OpenAI-compatible HTTP port")
    p.add_argument("--grpc-port", type=int, default=50051, help="public gRPC API port")
    p.add_argument("--internal-host", default="127.0.0.1", help="address the internal services bind")
    p.add_argument("--internal-port-base", type=int, default=30000, help="internal services use base+1 ...")
    p.add_argument("--num-prefill", type=int, default=1, help="prefill workers (PD mode)")
    p.add_argument("--num-decode", type=int, default=1, help="decode workers")
    p.add_argument(
        "--colocated", action="store_true", help="no prefill pool: decode workers prefill themselves"
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size per scheduler, in tokens")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool size per scheduler, in bytes")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch_native", "flashinfer"])
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--schedule-policy", default="fcfs", choices=["fcfs", "lpm"])
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument(
        "--router-policy", default="cache_aware", choices=["round_robin", "least_load", "cache_aware"]
    )
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None, help="require this key on the HTTP and gRPC APIs")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--log-level", default="info")
    apply_env_defaults(p)
    return p


async def launch(args: argparse.Namespace, stop: asyncio.Event) -> None:
    model_dir = str(await asyncio.to_thread(resolve_model, args.model))
    supervisor = Supervisor(build_topology(args, model_dir), startup_timeout=args.startup_timeout)
    try:
        starting = asyncio.create_task(supervisor.start_all())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()
            api = f"http://{args.host}:{args.port}/v1"
            print(f"pdserve is up: OpenAI API at {api}, gRPC at {args.host}:{args.grpc_port}", flush=True)
            await supervisor.watch(stop)
        else:
            starting.cancel()
    finally:
        await supervisor.stop_all()


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    setup_logging(args.log_level, "launch")
    run_service(lambda stop: launch(args, stop))


if __name__ == "__main__":
    main()
