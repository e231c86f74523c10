"""``pdserve launch``: a whole pdserve topology on one machine, supervised in the foreground.

Starts the tokenizer and detokenizer, then the prefill and decode schedulers, then the gateway, each
stage once the previous one answers its health checks; restarts a service that crashes (with
backoff) or hangs (its liveness check unanswered for --liveness-timeout: killed, then restarted),
a scheduler with the KV pool size of its first start; on Ctrl-C, SIGTERM or SIGHUP drains the
gateway first and stops every process it started (a second Ctrl-C kills them at once). Children
die with the launcher even if it is SIGKILLed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import ssl

from pdserve.cli_args import (
    add_chat_template_arg,
    add_engine_args,
    add_model_arg,
    check_lora_flags,
    non_negative_float,
    positive_int,
)
from pdserve.model_source import check_lora_names, resolve_model, served_model_names
from pdserve.observability.logs import add_logging_args, setup_logging
from pdserve.observability.stats_log import add_stats_args
from pdserve.observability.tracing import add_tracing_args
from pdserve.rpc import tls
from pdserve.rpc.server import run_service
from pdserve.services.common.chat_parser_args import add_chat_parser_args
from pdserve.services.common.kv_events_zmq_args import add_kv_events_args
from pdserve.services.common.supervision.console import Console, ConsoleHandler
from pdserve.services.common.supervision.spec import ServiceSpec
from pdserve.services.common.supervision.supervisor import DEFAULT_LIVENESS_TIMEOUT_S, Supervisor
from pdserve.services.launcher import config
from pdserve.services.launcher.kv_pool_pin import pin_first_pool
from pdserve.services.launcher.ports import PortReservation
from pdserve.services.launcher.topology import build_topology, visible_gpus

logger = logging.getLogger("pdserve.launch")

EPILOG = """\
Every option can also be set as an environment variable PDSERVE_<OPTION> (e.g. PDSERVE_NUM_DECODE=2,
PDSERVE_COLOCATED=1) or in a YAML file given with --config (or PDSERVE_CONFIG) whose keys are the
option names, with dashes or underscores (num-decode: 2, max_total_tokens: 16384, colocated: true).
Precedence: command line > environment > config file > defaults. Other PDSERVE_<FLAG> variables
reach the services, which read their own flags (e.g. PDSERVE_MAX_PENDING_REQUESTS) from them.
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's and epilog's line breaks; shows each option's default unless unset."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=110)

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return action.help
        return f"{action.help} (default: %(default)s)"


def make_parser() -> argparse.ArgumentParser:
    """The ``pdserve launch`` options (environment and config file are applied by ``parse_args``)."""
    p = argparse.ArgumentParser(
        prog="pdserve launch",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--config", default=None, help="YAML file of option values (see below)")
    add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="public bind address (gateway HTTP and gRPC API)")
    p.add_argument("--port", type=int, default=8000, help="OpenAI-compatible HTTP port")
    p.add_argument("--grpc-port", type=int, default=50051, help="public gRPC API port")
    p.add_argument(
        "--internal-host",
        default="127.0.0.1",
        help="address every internal service binds (and NIXL/UCX uses: its interface is UCX_NET_DEVICES)",
    )
    p.add_argument(
        "--internal-port-base",
        type=int,
        default=30000,
        help="internal ports: +1 tokenizer, +2 detokenizer, +3 gateway, +10+i prefill-i, +20+i decode-i",
    )
    p.add_argument(
        "--metrics-port-base",
        type=int,
        default=None,
        help="each service's /metrics port: this plus its internal port's offset (gateway: +3) "
        "(default: --internal-port-base + 100)",
    )
    p.add_argument("--num-prefill", type=int, default=1, help="prefill workers (PD mode)")
    p.add_argument("--num-decode", type=int, default=1, help="decode workers")
    p.add_argument(
        "--colocated", action="store_true", help="no prefill pool: decode workers prefill themselves"
    )
    p.add_argument(
        "--disable-forward-lock",
        action="store_true",
        help="on a CPU, let the schedulers' forwards run at once (by default they take turns at the cores: "
        "--forward-lock)",
    )
    add_engine_args(p)
    for role in ("prefill", "decode"):
        p.add_argument(
            f"--{role}-tp-size",
            type=positive_int,
            default=None,
            help=f"TP ranks of each {role} worker (colocated workers are decode workers); prefill and "
            f"decode of different sizes move KV in head slices (default: --tp-size)",
        )
    add_chat_template_arg(p)
    add_stats_args(p)
    add_kv_events_args(p)
    p.add_argument(
        "--gpus",
        default=None,
        help="comma-separated GPU ids the schedulers take in turn, prefill workers first "
        "(default: every visible GPU)",
    )
    p.add_argument(
        "--router-policy",
        default="kv_aware",
        choices=["round_robin", "least_load", "cache_aware", "kv_aware"],
        help="how the gateway picks workers (kv_aware: from the workers' KV events)",
    )
    p.add_argument(
        "--stream-interval",
        type=positive_int,
        default=1,
        help="tokens per streamed output (SSE event) of a request; its first and last go out at once",
    )
    p.add_argument(
        "--gateway-workers",
        type=positive_int,
        default=1,
        help="gateway processes sharing the HTTP and public gRPC ports, each owning its own requests",
    )
    add_chat_parser_args(p)
    p.add_argument(
        "--api-key",
        default=None,
        help="require an API key on the HTTP and gRPC APIs: one, or several comma-separated (one per "
        "client; a request's key owns it). Give them as PDSERVE_API_KEY or in --config: a command line "
        "is visible to every user in ps",
    )
    p.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds a service may take to become healthy"
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on shutdown (and a scheduler on its own SIGTERM), seconds in-flight requests get to finish "
        "(new ones: 503); the rest is aborted",
    )
    p.add_argument(
        "--liveness-timeout",
        type=non_negative_float,
        default=DEFAULT_LIVENESS_TIMEOUT_S,
        help="seconds a running service may leave its grpc.health.v1 check unanswered (stopped, "
        "stuck event loop, or a scheduler step past --watchdog-timeout) before it is killed and "
        "restarted; 0 = never",
    )
    add_logging_args(p)
    add_tracing_args(p)
    tls.add_tls_args(p)
    p.add_argument(
        "--public-client-ca",
        default=None,
        help="with --tls-*: require client certificates signed by this PEM CA on the public gRPC API",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options from command line, environment and config file (see ``config.parse_args``).

    Exits with status 2 and a message for a bad config file or an impossible topology.
    """
    parser = make_parser()
    args = config.parse_args(parser, argv)
    if args.num_decode < 1:
        parser.error("--num-decode must be at least 1")
    if args.num_prefill < 1 and not args.colocated:
        parser.error("--num-prefill must be at least 1 (or use --colocated)")
    if args.drain_timeout < 0:
        parser.error("--drain-timeout must not be negative")
    num_prefill = 0 if args.colocated else args.num_prefill
    internal_ports = max(10, 3 + args.gateway_workers) + max(10, num_prefill) + args.num_decode
    if (
        args.metrics_port_base is not None
        and abs(args.metrics_port_base - args.internal_port_base) < internal_ports
    ):
        parser.error(
            f"--metrics-port-base overlaps the {internal_ports} internal ports from --internal-port-base"
        )
    check_lora_flags(parser, args)
    try:  # what a child would refuse after the others' start-up, refused before any starts
        check_lora_names(
            [name for name, _ in args.lora_modules], served_model_names(args.model, args.served_model_name)
        )
    except ValueError as e:
        parser.error(str(e))
    if args.speculative_algorithm == "draft" and not args.speculative_draft_model_path:
        parser.error("--speculative-algorithm draft needs --speculative-draft-model-path")
    args.identity = tls.identity_from_args(parser, args)
    if args.public_client_ca and not args.identity:
        parser.error("--public-client-ca needs --tls-cert, --tls-key and --tls-ca")
    if args.kv_events_replay_endpoint and not args.kv_events_endpoint:
        parser.error("--kv-events-replay-endpoint needs --kv-events-endpoint")
    if args.kv_tier_memory and args.swa_full_tokens_ratio is not None:
        parser.error("--kv-tier-memory cannot be combined with --swa-full-tokens-ratio yet")
    if args.attention_backend == "flashinfer" and args.device == "cpu":
        parser.error("--attention-backend flashinfer runs on CUDA only (pdserve[cuda] on a GPU machine)")
    needs_gpu = args.device.startswith("cuda") or args.attention_backend == "flashinfer"
    if needs_gpu and not (args.gpus or visible_gpus()):
        flag = (
            f"--device {args.device}" if args.device.startswith("cuda") else "--attention-backend flashinfer"
        )
        parser.error(f"{flag} needs a CUDA GPU and none is visible (CUDA_VISIBLE_DEVICES, NVIDIA driver)")
    return args


async def launch(args: argparse.Namespace, stop: asyncio.Event, console: Console) -> None:
    """Start the topology, supervise it until ``stop`` is set (or a signal arrives), then stop it."""
    console.status("resolving the model ...")
    try:
        model_dir = str(await asyncio.to_thread(resolve_model, args.model, args.revision))
    except (OSError, ValueError) as e:
        logger.error("cannot use the model: %s", e)
        raise SystemExit(1) from None
    finally:
        console.status("")
    specs = build_topology(args, model_dir)
    reservation = _hold_ports(specs)
    tls.configure(args.identity)  # the health checks of the internal services speak mutual TLS
    supervisor = Supervisor(
        specs,
        console,
        startup_timeout=args.startup_timeout,
        drain_timeout=args.drain_timeout,
        http_verify=_https_health_context(args.tls_ca) if args.identity else True,
        liveness_timeout=args.liveness_timeout,
        on_ready=pin_first_pool,
    )

    def on_signal() -> None:
        if stop.is_set():
            logger.warning("second signal: killing every service now")
            supervisor.kill_all()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal)
    try:
        if await _start(supervisor, stop):
            scheme, over = ("https", " over TLS") if args.identity else ("http", "")
            console.announce(
                f"pdserve is up: OpenAI API at {scheme}://{args.host}:{args.port}/v1, "
                f"gRPC at {args.host}:{args.grpc_port}{over} (Ctrl-C to stop)"
            )
            await supervisor.supervise(stop)
            logger.info("shutting down: draining the gateway (up to %.0f s)", args.drain_timeout)
    finally:
        await supervisor.stop_all()
        reservation.close()
        logger.info("every service stopped")


def _hold_ports(specs: list[ServiceSpec]) -> PortReservation:
    """Every fixed port, held before anything starts so that no ephemeral port can take it (see
    ``ports``); exits with status 1 naming the ports something already listens on."""
    reservation = PortReservation(bind for spec in specs for bind in spec.binds)
    if reservation.taken:
        reservation.close()
        logger.error(
            "cannot start: %s already in use (another pdserve?); choose other --port, --grpc-port "
            "or --internal-port-base",
            ", ".join(f"{host}:{port}" for host, port in reservation.taken),
        )
        for (host, port), holders in reservation.holders.items():
            logger.error("%s:%d is held by: %s", host, port, "; ".join(holders) or "nothing visible here")
        raise SystemExit(1)
    return reservation


def _https_health_context(ca: str) -> ssl.SSLContext:
    """Verifies the gateway's certificate against the internal CA, not its name: the launcher dials
    its own child at the address it gave it (the certificate may name only --tls-server-name)."""
    context = ssl.create_default_context(cafile=ca)
    context.check_hostname = False
    return context


async def _start(supervisor: Supervisor, stop: asyncio.Event) -> bool:
    """Start every service; False if ``stop`` was set first. Exits with status 1 if one fails to start."""
    starting = asyncio.ensure_future(supervisor.start_all())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not starting.done():
        logger.info("stop requested during start-up")
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return False
    try:
        starting.result()
    except RuntimeError as e:
        logger.error("start-up failed: %s", e)
        raise SystemExit(1) from None
    return True


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.log_level, "launch", args.log_format)
    console = Console(json_lines=args.log_format == "json")
    handler = ConsoleHandler(console)
    root = logging.getLogger()
    handler.setFormatter(root.handlers[0].formatter)
    root.handlers = [handler]
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not every health poll
    run_service(lambda stop: launch(args, stop, console))


if __name__ == "__main__":
    main()
