"""Gateway entry point: ``pdserve gateway [flags]`` (every flag also from env ``PDSERVE_<FLAG>``).

One asyncio loop (uvloop) runs three servers. Public (``--host``): uvicorn for the HTTP API and a
grpc.aio server for the ``PdServe`` API (plus health and reflection), nothing else. Internal
(``--internal-host``): a grpc.aio server for the ``GatewayOutput`` streams from the detokenizers, which
a public client never reaches (it would otherwise name another client's rid and write into its stream).
With ``--tls-*`` the internal server demands client certificates from the internal CA, and the public
listeners serve TLS (see ``public_tls``). ``--workers N`` runs N such gateways on the same public
ports (``processes``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import sys

import uvicorn
from prometheus_client import REGISTRY

from pdserve.cli_args import (
    add_lora_modules_arg,
    add_model_arg,
    add_observability_args,
    apply_env_defaults,
    non_negative_int,
    positive_float,
    positive_int,
    setup_service,
    weight,
)
from pdserve.model_source import check_lora_names, served_model_names
from pdserve.observability.metrics_http import labelled, serve_metrics
from pdserve.rpc import tls
from pdserve.rpc.server import GrpcServer, run_service
from pdserve.services.common.chat_parser_args import add_chat_parser_args
from pdserve.services.gateway.app import GatewayState, build_app
from pdserve.services.gateway.auth import ApiKeyInterceptor, parse_api_keys
from pdserve.services.gateway.lora_admin import LoraAdmin
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.openai.reasoning_parser import ReasoningParser
from pdserve.services.gateway.openai.responses.store import DEFAULT_MAX_PER_KEY, DEFAULT_TTL_S, ResponseStore
from pdserve.services.gateway.openai.serving_common import ServingContext
from pdserve.services.gateway.openai.tool_parsers import TOOL_PARSERS
from pdserve.services.gateway.public_tls import PublicTls, add_public_tls_args, public_tls_from_args
from pdserve.services.gateway.requests.manager import ManagerConfig, RequestManager
from pdserve.services.gateway.requests.migration import MAX_MIGRATION_LIMIT
from pdserve.services.gateway.requests.state import RequestRegistry
from pdserve.services.gateway.routing.discovery import DEFAULT_INTERVAL_S, Discovery
from pdserve.services.gateway.routing.kv_subscriptions import KVIndexes
from pdserve.services.gateway.routing.policies import DEFAULT_POLICY, POLICIES, KVAwareWeights
from pdserve.services.gateway.routing.router import Router
from pdserve.services.gateway.routing.worker_monitor import WorkerMonitor
from pdserve.services.gateway.transport import output_servicer, public_servicer
from pdserve.services.gateway.transport.backend_clients import BackendClients
from pdserve.services.gateway.transport.interceptors import MalformedRequestInterceptor
from pdserve.services.gateway.transport.output_servicer import GatewayOutputServicer
from pdserve.services.gateway.transport.public_servicer import PdServeServicer

logger = logging.getLogger("pdserve.gateway")

PUBLIC_SERVICES = [public_servicer.SERVICE_NAME]
INTERNAL_SERVICES = [output_servicer.SERVICE_NAME]
ROLES = ("tokenizer", "detokenizer", "decode", "prefill")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve gateway", description=__doc__)
    add_model_arg(p)
    add_lora_modules_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address the public servers (HTTP, gRPC API) bind")
    p.add_argument("--port", type=int, default=8000, help="HTTP (OpenAI API) port; 0 = any free")
    p.add_argument("--grpc-port", type=int, default=50051, help="public gRPC API port (PdServe); 0 = any")
    p.add_argument(
        "--internal-host", default="127.0.0.1", help="address the internal gRPC server (GatewayOutput) binds"
    )
    p.add_argument("--internal-grpc-port", type=int, default=0, help="internal gRPC port; 0 = any free")
    p.add_argument(
        "--advertise-host",
        default=None,
        help="host the detokenizers reach the internal server at (default: --internal-host)",
    )
    p.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="with public TLS: a plaintext port serving only grpc.health.v1, for probes without TLS",
    )
    for role in ROLES:
        p.add_argument(
            f"--{role}-addresses",
            default="",
            help=f"comma-separated host:port of the {role} workers; dns:<name>:<port> (decode, prefill) "
            "stands for every address <name> resolves to, resolved again every --discovery-interval",
        )
    p.add_argument(
        "--discovery-interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        help="seconds between DNS resolutions of dns:<name>:<port> scheduler addresses",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' (HTTP and gRPC); several keys comma-separated, one "
        "per client: a request can be aborted only with the key it was sent with",
    )
    p.add_argument(
        "--router-policy",
        default=DEFAULT_POLICY,
        choices=POLICIES,
        help="how each request's workers are picked; kv_aware: cached prefix (from the workers' KV "
        "events) against load; cache_aware: the gateway's own guess of the caches (docs/api.md)",
    )
    defaults = KVAwareWeights()
    p.add_argument(
        "--router-kv-overlap-weight",
        type=weight,
        default=defaults.overlap_weight,
        help="kv_aware: weight (0-100) of the prompt's cached fraction on a worker",
    )
    p.add_argument(
        "--router-load-weight",
        type=weight,
        default=defaults.load_weight,
        help="kv_aware: weight (0-100) of a worker's load over the most loaded candidate's",
    )
    p.add_argument(
        "--router-kv-event-lag",
        type=positive_float,
        default=defaults.lag_s,
        help="kv_aware: seconds a worker may send no KV event batch after a request went to it before "
        "its index is distrusted (it is then routed by load alone until its next batch)",
    )
    p.add_argument(
        "--max-pending-requests",
        type=non_negative_int,
        default=None,
        help="sub-requests (prompts x n) in flight before new requests get 429; 0 = no limit; default: "
        "sized from the decode workers' KV pools (the sum of the requests each can run at once and queue)",
    )
    p.add_argument("--max-request-bytes", type=int, default=32 << 20, help="larger bodies get 413")
    p.add_argument(
        "--request-body-timeout",
        type=positive_float,
        default=30.0,
        help="seconds an HTTP request's body may take to arrive in full, from its headers; a slower "
        "one gets 408 and its connection is closed (a 32 MiB body then needs ~1.1 MB/s)",
    )
    p.add_argument("--request-timeout", type=float, default=None, help="seconds before a request is aborted")
    p.add_argument("--default-max-tokens", type=int, default=4096, help="cap of the default max_tokens")
    p.add_argument("--health-check-interval", type=float, default=1.0, help="seconds between worker probes")
    p.add_argument(
        "--migration-limit",
        type=int,
        choices=range(MAX_MIGRATION_LIMIT + 1),
        metavar=f"[0-{MAX_MIGRATION_LIMIT}]",
        default=3,
        help="times a request may move to another decode worker when its own dies, hangs or drains "
        "(resumed from the tokens already sent); 0 = it ends with a retryable error (docs/operations.md)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=5.0,
        help="on shutdown, seconds in-flight HTTP requests get to finish before they are aborted",
    )
    add_chat_parser_args(p)
    p.add_argument(
        "--responses-store-size",
        type=non_negative_int,
        default=DEFAULT_MAX_PER_KEY,
        help="/v1/responses: stored responses kept per API key (least recently used dropped first; "
        "0 = none stored, so previous_response_id always 404s)",
    )
    p.add_argument(
        "--responses-ttl",
        type=positive_float,
        default=DEFAULT_TTL_S,
        help="/v1/responses: seconds a stored response is kept after its last use",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="gateway processes sharing --port and --grpc-port (SO_REUSEPORT), each owning its own "
        "requests; worker i takes its outputs on its own internal server, --internal-grpc-port + i "
        "(and serves its metrics on --metrics-port + i)",
    )
    p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # set for each worker
    p.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn's access log)")
    p.add_argument(
        "--log-requests", action="store_true", help="log one line per request as it ends (rid, tokens, time)"
    )
    add_observability_args(p)
    tls.add_tls_args(p)
    add_public_tls_args(p)
    apply_env_defaults(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The gateway's flags; ``args.identity`` (internal mTLS) and ``args.public_tls`` are resolved
    from the TLS flags (None: plaintext). Exits with status 2 on a missing backend or bad TLS flags."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for role in ("tokenizer", "detokenizer", "decode"):
        if not addresses(getattr(args, f"{role}_addresses")):
            parser.error(f"--{role}-addresses is required")
    if args.workers > 1 and not args.internal_grpc_port:
        parser.error("--workers needs a fixed --internal-grpc-port (worker i listens on it + i)")
    args.api_keys = parse_api_keys(args.api_key)
    args.identity = tls.identity_from_args(parser, args)
    args.public_tls = public_tls_from_args(parser, args)
    args.lora_names = [name for name, _ in args.lora_modules]
    try:
        args.model_names = served_model_names(args.model, args.served_model_name)
        check_lora_names(args.lora_names, args.model_names)
    except ValueError as e:
        parser.error(str(e))
    return args


def addresses(value: str) -> list[str]:
    return [a.strip() for a in value.split(",") if a.strip()]


_HTTP_CLOSE_TIMEOUT_S = 5.0  # after the drain, for responses to flush (every request has ended)
# uvicorn's h11 parser buffers at most this much of a request head that has not ended (more: a 400 and
# the connection closed); its httptools parser, picked by default, buffered one 256 MiB header whole.
MAX_INCOMPLETE_HEAD_BYTES = 64 << 10


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside a running loop: signals are the caller's (``run_service`` sets ``stop_event``)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Gateway:
    """The servers of one gateway replica, started by ``start`` and stopped by ``stop``.

    Sets this process's internal TLS identity (``tls.configure``) from ``args.identity``.

    Attributes:
        http_port, grpc_port: the bound public ports (useful with port 0).
        grpc_address: "host:port" of the public gRPC API.
        internal_address: the advertised "host:port" that detokenizers push outputs to.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        tls.configure(args.identity)
        public_tls: PublicTls | None = args.public_tls
        self.discovery = Discovery({role: getattr(args, f"{role}_addresses") for role in ROLES})
        pools = {role: self.discovery.pool(role) for role in ROLES}
        self.clients = BackendClients()
        self.metrics = GatewayMetrics(args.model_names[0])
        self.registry = RequestRegistry()
        self.kv_indexes = {
            role: KVIndexes(self.clients, pools[role], args.health_check_interval)
            for role in ("decode", "prefill")
            if args.router_policy == "kv_aware"
        }
        for indexes in self.kv_indexes.values():
            self.metrics.registry.register(indexes)
        weights = KVAwareWeights(
            args.router_kv_overlap_weight, args.router_load_weight, args.router_kv_event_lag
        )
        self.router = Router(pools["decode"], pools["prefill"], args.router_policy, self.kv_indexes, weights)
        # the API key is checked first: a call without it is UNAUTHENTICATED, however malformed
        keys = [ApiKeyInterceptor(args.api_keys)] if args.api_keys else []
        self.grpc = GrpcServer(
            f"{args.host}:{args.grpc_port}",
            PUBLIC_SERVICES,
            [*keys, MalformedRequestInterceptor()],
            credentials=public_tls.grpc_credentials() if public_tls else None,
            health_address=None if args.health_port is None else f"{args.host}:{args.health_port}",
            reuse_port=args.reuse_port,
        )
        self.grpc_port = self.grpc.port
        self.grpc_address = f"{args.host}:{self.grpc_port}"
        self.internal = GrpcServer(
            f"{args.internal_host}:{args.internal_grpc_port}",
            INTERNAL_SERVICES,
            credentials=tls.server_credentials(),
        )
        self.internal_address = f"{args.advertise_host or args.internal_host}:{self.internal.port}"
        config = ManagerConfig(
            gateway_address=self.internal_address,
            max_pending_requests=args.max_pending_requests,
            request_timeout=args.request_timeout,
            default_max_tokens=args.default_max_tokens,
            log_requests=args.log_requests,
            migration_limit=args.migration_limit,
        )
        self.manager = RequestManager(
            config,
            self.clients,
            self.router,
            pools["tokenizer"],
            pools["detokenizer"],
            self.registry,
            self.metrics,
        )
        migrator = self.manager.migrator
        self.monitor = WorkerMonitor(
            self.clients, pools, self.router, migrator.worker_down, args.health_check_interval,
            on_drain=migrator.worker_draining,
        )  # fmt: skip
        self.discovery.on_removed = self.monitor.remove
        self.ctx = ctx = ServingContext(
            self.manager,
            args.model_names,
            TOOL_PARSERS[args.tool_call_parser]() if args.tool_call_parser else None,
            ReasoningParser(args.reasoning_parser) if args.reasoning_parser else None,
            args.lora_names,
        )
        lora_admin = LoraAdmin(
            ctx,
            self.clients,
            {"prefill": pools["prefill"], "decode": pools["decode"]},
            dict(args.lora_modules),
            "run-time LoRA loading needs one gateway (--gateway-workers 1)" if args.workers > 1 else "",
        )
        self.grpc.add(public_servicer.add_to_server, PdServeServicer(ctx, lora_admin, args.api_keys))
        self.internal.add(output_servicer.add_to_server, GatewayOutputServicer(self.registry))
        state = GatewayState(
            ctx=ctx,
            monitor=self.monitor,
            clients=self.clients,
            metrics=self.metrics,
            metric_pools=[pools["decode"], pools["prefill"], pools["detokenizer"]],
            worker_name=self.internal_address,
            responses=ResponseStore(args.responses_store_size, args.responses_ttl),
            lora=lora_admin,
        )
        app = build_app(
            state,
            api_keys=args.api_keys,
            max_request_bytes=args.max_request_bytes,
            request_body_timeout=args.request_body_timeout,
        )
        uv_config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            loop="uvloop",
            log_level=args.log_level.lower(),
            log_config=None,  # uvicorn's lines (and its access log) go through our handler and format
            access_log=args.access_log or args.log_level.lower() == "debug",
            timeout_graceful_shutdown=_HTTP_CLOSE_TIMEOUT_S,
            http="h11",
            h11_max_incomplete_event_size=MAX_INCOMPLETE_HEAD_BYTES,
            **(public_tls.uvicorn_options() if public_tls else {}),
        )
        self.http = _EmbeddedUvicorn(uv_config)
        self.http_port = args.port
        self._http_task: asyncio.Task | None = None
        self._metrics_server = None

    async def start(self) -> None:
        """Start the gRPC servers (SERVING), the worker monitor, then uvicorn; returns once all listen.

        Raises:
            RuntimeError: uvicorn failed to start (e.g. the port is taken).
        """
        await self.discovery.start(self.args.discovery_interval)
        await self.internal.start()
        await self.grpc.start()
        await self.grpc.set_serving(True)
        self.monitor.start()
        for indexes in self.kv_indexes.values():
            indexes.start()
        exposed = labelled(self.metrics.registry, REGISTRY, model_name=self.ctx.served_model_name)
        self._metrics_server = serve_metrics(self.args, self.args.host, exposed)
        sockets = [reuse_port_socket(self.args.host, self.args.port)] if self.args.reuse_port else None
        self._http_task = asyncio.get_running_loop().create_task(self.http.serve(sockets))
        while not self.http.started:
            if self._http_task.done():
                await self.stop()
                raise RuntimeError(f"HTTP server failed to start on {self.args.host}:{self.args.port}")
            await asyncio.sleep(0.05)
        self.http_port = self.http.servers[0].sockets[0].getsockname()[1]
        # the internal server's health is this replica's own (its public ports may be shared by
        # --workers): SERVING once its HTTP side listens too
        await self.internal.set_serving(True)
        args = self.args
        logger.info(
            "gateway up: HTTP%s %s:%d, public gRPC %s, internal gRPC %s%s, model %r, router %s",
            "S" if args.public_tls else "", args.host, self.http_port, self.grpc_address,
            self.internal_address, " (mTLS)" if args.identity else "", self.ctx.served_model_name,
            args.router_policy,
        )  # fmt: skip

    async def stop(self) -> None:
        """Drain, then close both servers and all channels. While in-flight requests get up to
        ``--drain-timeout`` to finish, both servers keep listening: new generation requests get a
        503 (gRPC UNAVAILABLE), ``/health`` says "draining" and gRPC health NOT_SERVING, so a load
        balancer moves on; what is still running after that is aborted."""
        for server in (self.grpc, self.internal):  # grpc.health.v1 says NOT_SERVING during the drain
            await server.set_serving(False)
        await self.manager.drain(self.args.drain_timeout)
        self.http.should_exit = True
        if self._http_task is not None:
            with contextlib.suppress(SystemExit, Exception):
                await self._http_task
        await self.monitor.stop()
        for indexes in self.kv_indexes.values():
            await indexes.stop()
        await self.discovery.stop()
        if self._metrics_server is not None:
            self._metrics_server.close()
        await self.grpc.stop(grace=2.0)
        await self.internal.stop(grace=2.0)
        await self.clients.close()


async def serve(args: argparse.Namespace, stop_event: asyncio.Event) -> None:
    """Run a gateway until ``stop_event`` is set."""
    gateway = Gateway(args)
    await gateway.start()
    await stop_event.wait()
    await gateway.stop()


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` that other processes may bind too (SO_REUSEPORT): the
    kernel spreads new connections over the gateway workers."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    setup_service(args, "gateway")
    if args.workers > 1:
        from pdserve.services.gateway.processes import serve_workers

        run_service(lambda stop: serve_workers(args, argv, stop))
    else:
        run_service(lambda stop: serve(args, stop))


if __name__ == "__main__":
    main()
