"""Start a grpc.aio server with the standard health and reflection services.

Every pdserve service runs exactly one of these in its own OS process, on uvloop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable, Sequence

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.observability.rpc_observer import RpcObserver
from pdserve.rpc import tls

logger = logging.getLogger(__name__)

# Messages up to 256 MiB: prompts of many thousand ids and metrics texts fit easily.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.max_receive_message_length", 256 << 20),
    # a hung or unreachable peer is noticed within ~4 s (keepalive ping every 2 s, 2 s to answer)
    ("grpc.keepalive_time_ms", 2_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # servers accept those pings (the default minimum interval is 5 minutes)
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    # clients: spread calls over every address a target resolves to (a dns:/// name of a headless
    # Service resolves to each ready pod), one call to the next address in turn (servers ignore it)
    ("grpc.lb_policy_name", "round_robin"),
    # clients: a restarted peer (the launcher restarts a process within ~1 s) is reachable again
    # within a second of coming back, not after gRPC's default backoff (1 s growing to 120 s)
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


class GrpcServer:
    """A grpc.aio server plus its health servicer.

    Args:
        address: "host:port" to bind; port 0 picks a free one (see ``port``).
        service_names: full names of the services registered (for health and reflection).
        interceptors: grpc.aio server interceptors (cross-cutting concerns such as authentication),
            after ``RpcObserver`` (RPC metrics, the rid in log lines).
        credentials: TLS of the port (e.g. ``tls.server_credentials()``); None = plaintext.
        health_address: with TLS, "host:port" of a second, plaintext listener that serves only
            ``grpc.health.v1`` (same statuses), for probes that cannot speak TLS (Kubernetes' gRPC
            probes); None = none.
        reuse_port: bind with SO_REUSEPORT, so that several processes serve one port (the kernel
            spreads connections over them); off by default, so that a taken port fails.

    Raises:
        OSError: a port cannot be bound (e.g. it is taken).

    Usage: ``server.add(add_XServicer_to_server, servicer)`` for each servicer, then ``await start()``;
    call ``set_serving(True)`` once the service is ready to take traffic.
    """

    def __init__(
        self,
        address: str,
        service_names: Iterable[str],
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        credentials: grpc.ServerCredentials | None = None,
        health_address: str | None = None,
        reuse_port: bool = False,
    ) -> None:
        options = [*GRPC_OPTIONS, ("grpc.so_reuseport", int(reuse_port))]
        self.server = grpc.aio.server(options=options, interceptors=[RpcObserver(), *interceptors])
        self.port = _bind(self.server, address, credentials)
        self.address = f"{address.rsplit(':', 1)[0]}:{self.port}"
        self.service_names = list(service_names)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._health_server: grpc.aio.Server | None = None
        if health_address and credentials is not None:
            self._health_server = grpc.aio.server(options=options)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
            _bind(self._health_server, health_address, None)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )

    def add(self, register: Callable[[object, grpc.aio.Server], None], servicer: object) -> None:
        register(servicer, self.server)

    async def start(self) -> None:
        await self.server.start()
        if self._health_server is not None:
            await self._health_server.start()
        logger.info("gRPC server listening on %s (%s)", self.address, ", ".join(self.service_names))

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def set_draining(self) -> None:
        """Report every registered service NOT_SERVING while the server as a whole ("") stays SERVING:
        alive, but taking no new work (readiness off, liveness on)."""
        for name in self.service_names:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float = 5.0) -> None:
        """Report NOT_SERVING to every health watcher, then stop; in-flight calls get ``grace`` seconds."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self._health_server is not None:
            await self._health_server.stop(grace)


def _bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as e:
        raise OSError(f"cannot listen on {address} (is the port taken?): {e}") from None


def internal_server(args: argparse.Namespace, service_names: Iterable[str]) -> GrpcServer:
    """The gRPC server of an internal service from its ``add_server_args`` flags: ``--host:--port``,
    mutual TLS when this process has an identity (``tls.configure``), and ``--health-port``."""
    health_address = None if args.health_port is None else f"{args.host}:{args.health_port}"
    return GrpcServer(
        f"{args.host}:{args.port}",
        service_names,
        credentials=tls.server_credentials(),
        health_address=health_address,
    )


def run_service(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``main(stop_event)`` on uvloop; SIGINT/SIGTERM set ``stop_event`` for a graceful stop."""

    async def _runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    uvloop.run(_runner())


async def wait_for_health(address: str, timeout: float, service: str = "") -> bool:
    """Poll ``grpc.health.v1`` at ``address`` (an internal service: over this process's TLS, see
    ``tls.internal_channel``) until SERVING or ``timeout`` seconds pass."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with tls.internal_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.aio.AioRpcError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.2)
