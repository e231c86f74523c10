"""The flags of KV events in vLLM's ZMQ wire format (``kv_events_zmq``), apart from it so that the
launcher, which passes them on, imports neither ZMQ nor torch."""

from __future__ import annotations

import argparse

SCHEMES = ("tcp://", "ipc://", "inproc://")


def zmq_endpoint(text: str) -> str:
    """argparse type: a ZMQ endpoint of scheme tcp://, ipc:// or inproc://."""
    if not text.startswith(SCHEMES):
        raise argparse.ArgumentTypeError(
            f"expected a ZMQ endpoint (tcp://host:port, ipc://path), got {text!r}"
        )
    return text


def offset_endpoint(endpoint: str, offset: int) -> str:
    """``endpoint`` of the ``offset``-th scheduler of one machine, as vLLM offsets it per data
    parallel rank: a tcp port plus ``offset``, an ipc/inproc path with ``_dp<offset>`` appended."""
    if offset == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, port = endpoint.rsplit(":", 1)
        return f"{host}:{int(port) + offset}"
    return f"{endpoint}_dp{offset}"


def add_kv_events_args(parser: argparse.ArgumentParser) -> None:
    """``--kv-events-endpoint``, ``--kv-events-replay-endpoint``, ``--kv-events-topic`` (vLLM's
    ``KVEventsConfig`` fields ``endpoint``, ``replay_endpoint``, ``topic``)."""
    parser.add_argument(
        "--kv-events-endpoint",
        type=zmq_endpoint,
        default=None,
        help="also publish KV events in vLLM's KVEvents wire format on this ZMQ PUB endpoint: bound "
        "when it has a wildcard (tcp://*:5557) or is ipc/inproc, else connected (docs/kv-events.md); "
        "pdserve launch gives scheduler i the port + i; default: off",
    )
    parser.add_argument(
        "--kv-events-replay-endpoint",
        type=zmq_endpoint,
        default=None,
        help="with --kv-events-endpoint: a ZMQ ROUTER endpoint (bound) that replays the last 10,000 "
        "batches from a sequence number",
    )
    parser.add_argument("--kv-events-topic", default="", help="the ZMQ topic frame of every batch")


def kv_events_flags(args: argparse.Namespace, index: int) -> list[str]:
    """The launcher's flags for its ``index``-th scheduler (its endpoints offset by ``index``)."""
    if not args.kv_events_endpoint:
        return []
    flags = ["--kv-events-endpoint", offset_endpoint(args.kv_events_endpoint, index)]
    if args.kv_events_replay_endpoint:
        flags += ["--kv-events-replay-endpoint", offset_endpoint(args.kv_events_replay_endpoint, index)]
    return flags + ["--kv-events-topic", args.kv_events_topic]
