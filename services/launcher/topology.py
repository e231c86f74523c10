"""Which processes a one-machine deployment runs, with their flags and ports.

Ports: the gateway's public servers bind ``--host``: ``--port`` (HTTP) and ``--grpc-port`` (public
gRPC API; with ``--gateway-workers N`` every worker binds both, SO_REUSEPORT). Everything else binds
``--internal-host``: ``--internal-port-base`` + 1 (tokenizer), + 2 (detokenizer), + 3 + i (gateway
worker i's internal gRPC server, where detokenizers stream outputs to), + 10 + i (prefill-i) and
+ 20 + i (decode-i). With more than 7 gateway workers the prefill ports start right after the last
gateway port, and with more than 10 prefill workers the decode ports right after the last prefill
port. Each service serves its Prometheus metrics at ``--metrics-port-base`` (default
``--internal-port-base`` + 100) plus the offset of its internal port (gateway worker i: + 3 + i).
With ``--tls-*`` every service gets the same certificate flags.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from pdserve.model_source import served_model_names
from pdserve.services.common.kv_events_zmq_args import kv_events_flags
from pdserve.services.common.supervision.spec import ServiceSpec


def _engine_flags(args: argparse.Namespace, per_device: int) -> list[str]:
    """The scheduler flags; ``per_device`` schedulers share a device, so without an explicit KV
    budget each takes that share of ``--kv-memory-fraction`` (they all start at once and would
    each see the same free memory)."""
    flags = [
        "--dtype", args.dtype,
        "--quantization", args.quantization,
        "--kv-cache-dtype", args.kv_cache_dtype,
        "--page-size", str(args.page_size),
        "--attention-backend", args.attention_backend,
        "--device", args.device,
        "--max-running-requests", str(args.max_running_requests),
        "--chunked-prefill-size", str(args.chunked_prefill_size),
        "--schedule-policy", args.schedule_policy,
        "--max-queue-time", f"{args.max_queue_time:g}",
        "--watchdog-timeout", f"{args.watchdog_timeout:g}",
    ]  # fmt: skip
    flags += [
        "--speculative-algorithm", args.speculative_algorithm,
        "--speculative-num-draft-tokens", str(args.speculative_num_draft_tokens),
        "--speculative-policy", args.speculative_policy,
    ]  # fmt: skip
    if args.speculative_draft_model_path:
        flags += ["--speculative-draft-model-path", args.speculative_draft_model_path]
    if args.max_queued_requests is not None:
        flags += ["--max-queued-requests", str(args.max_queued_requests)]
    if args.max_total_tokens:
        flags += ["--max-total-tokens", str(args.max_total_tokens)]
    if args.kv_cache_memory:
        flags += ["--kv-cache-memory", str(args.kv_cache_memory)]
    if args.swa_full_tokens_ratio is not None:
        flags += ["--swa-full-tokens-ratio", f"{args.swa_full_tokens_ratio:g}"]
    if args.kv_tier_memory:
        flags += ["--kv-tier-memory", str(args.kv_tier_memory)]
    if not (args.max_total_tokens or args.kv_cache_memory):
        flags += ["--kv-memory-fraction", f"{args.kv_memory_fraction / per_device:.4g}"]
    if args.disable_radix_cache:
        flags.append("--disable-radix-cache")
    if args.disable_cuda_graph:
        flags.append("--disable-cuda-graph")
    if args.disable_overlap_schedule:
        flags.append("--disable-overlap-schedule")
    if args.enable_overlap_schedule:
        flags.append("--enable-overlap-schedule")
    if args.enable_expert_parallel:
        flags.append("--enable-expert-parallel")
    if args.enable_lora or args.lora_modules:
        flags += ["--enable-lora", "--max-loras", str(args.max_loras)]
        flags += [
            "--max-loaded-loras",
            str(args.max_loaded_loras),
            "--max-lora-rank",
            str(args.max_lora_rank),
        ]
        flags += lora_modules_flag(args)
    return flags


def role_tp_size(args: argparse.Namespace, role: str) -> int:
    """TP ranks of a ``prefill`` or ``decode`` scheduler: ``--prefill-tp-size`` / ``--decode-tp-size``
    (colocated workers are decode workers), else ``--tp-size``."""
    return getattr(args, f"{role}_tp_size", None) or args.tp_size


def lora_modules_flag(args: argparse.Namespace) -> list[str]:
    """``--lora-modules name=path ...`` as given (schedulers load them, the gateway serves the names)."""
    return (
        ["--lora-modules", *(f"{name}={path}" for name, path in args.lora_modules)]
        if args.lora_modules
        else []
    )


def scheduler_env() -> dict[str, str]:
    """Environment of the scheduler processes, which share this machine's cores with each other and
    with the gateway, tokenizer and detokenizer: OpenMP threads spin ~30 us (``GOMP_SPINCOUNT``
    3000) at the end of a parallel region, then sleep.

    libgomp's default spins ~3 ms after every parallel region, so between forwards, and whenever
    another process holds a core, a scheduler's team burns cores the other services need (PD 1+1
    on 2 cores: 61 vs 153 output tok/s at concurrency 16 against sleeping at once). Sleeping at
    once (``OMP_WAIT_POLICY=PASSIVE``) pays a futex wake-up at every barrier of a forward, a few
    hundred per step: SmolLM2 bf16 batch-1 decode 56 vs 103 tok/s in-process, and through the
    colocated stack one stream 19.3 vs 12.8 ms per token, for the same decode CPU per token (21.4
    vs 21.6 ms; 2026-12-02, 2-core Zen 5). The short spin covers a forward's back-to-back regions
    and ends before the next step. A ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` of the launcher's
    own environment wins.
    """
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return {}
    return {"GOMP_SPINCOUNT": "3000"}


def tls_flags(args: argparse.Namespace) -> list[str]:
    """The ``--tls-*`` flags every service gets (file paths, not secrets: the key stays in its file)."""
    flags = []
    for name in ("tls_cert", "tls_key", "tls_ca", "tls_server_name"):
        if value := getattr(args, name):
            flags += [f"--{name.replace('_', '-')}", value]
    return flags


def visible_gpus() -> list[str]:
    """GPU ids the schedulers may use: ``CUDA_VISIBLE_DEVICES`` when set, else one per GPU the
    NVIDIA driver lists (``/proc/driver/nvidia/gpus``, or ``/dev/nvidiaN`` device nodes where the
    driver's proc files are not mounted); the launcher itself imports no torch."""
    if (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        return [gpu.strip() for gpu in visible.split(",") if gpu.strip()]
    driver = Path("/proc/driver/nvidia/gpus")
    if driver.is_dir():
        return [str(i) for i in range(len(list(driver.iterdir())))]
    nodes = [p.name.removeprefix("nvidia") for p in Path("/dev").glob("nvidia[0-9]*")]
    return sorted((n for n in nodes if n.isdigit()), key=int)


def scheduler_gpus(args: argparse.Namespace) -> list[str]:
    """GPU ids the scheduler processes take in turn (prefill workers first): ``--gpus``, else every
    visible GPU; none for ``--device cpu`` or an explicit ``cuda:i`` (no remapping)."""
    if args.device not in ("auto", "cuda"):
        return []
    return args.gpus.split(",") if args.gpus else visible_gpus()


def forward_lock_flags(
    args: argparse.Namespace, gpus: list[str], schedulers: int, tp_sizes: set[int]
) -> list[str]:
    """``--forward-lock PATH`` for every scheduler when they share this machine's CPU cores: on a CPU
    (no GPU taken, ``--device`` ``auto`` or ``cpu``), more than one scheduler, none tensor-parallel
    (a TP rank waiting for its turn would hold its peers at their collectives), unless
    ``--disable-forward-lock``. The file is named after this user and ``--internal-port-base``,
    which no other deployment on the machine can bind (another user's file from an earlier run
    could not be opened)."""
    on_cpu = not gpus and args.device in ("auto", "cpu")
    if args.disable_forward_lock or not on_cpu or schedulers < 2 or tp_sizes != {1}:
        return []
    name = f"pdserve-{os.getuid()}-{args.internal_port_base}.forward.lock"
    return ["--forward-lock", str(Path(tempfile.gettempdir()) / name)]


def _gpu_env(gpus: list[str], first: int, count: int) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` of a scheduler whose ``count`` ranks take the GPUs from the ``first``-th
    on (one per TP rank; the schedulers before it took the ones before), in turn, so PD 2+2 on four
    GPUs gets one each and with ``--tp-size 2`` on eight, two each."""
    if not gpus:
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpus[(first + r) % len(gpus)] for r in range(count))}


def observability_flags(args: argparse.Namespace, served_name: str) -> list[str]:
    """Logging, tracing and the served model name, the same for every service."""
    flags = [
        "--log-level",
        args.log_level,
        "--log-format",
        args.log_format,
        "--served-model-name",
        served_name,
    ]
    if args.otlp_traces_endpoint:
        flags += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    return flags


def metrics_port_base(args: argparse.Namespace) -> int:
    """First port of the metrics block: ``--metrics-port-base``, else ``--internal-port-base`` + 100."""
    return args.metrics_port_base if args.metrics_port_base is not None else args.internal_port_base + 100


def _metrics_port(port: int, args: argparse.Namespace, host: str) -> tuple[list[str], list[tuple[str, int]]]:
    """The flag and bind of the metrics port of the service whose internal port is ``port``."""
    metrics = metrics_port_base(args) + port - args.internal_port_base
    return ["--metrics-port", str(metrics)], [(host, metrics)]


def build_topology(args: argparse.Namespace, model_dir: str) -> list[ServiceSpec]:
    """Services in start order: tokenizer, detokenizer, prefill workers, decode workers, gateway.

    Every service gets the same ``--served-model-name`` (from the user's ``--model``, not from
    ``model_dir``, which may be a download or conversion cache): the names in responses and the
    ``model_name`` label of metrics.
    """
    served_name = ",".join(served_model_names(args.model, args.served_model_name))
    host = args.internal_host
    base = args.internal_port_base
    common = ["--model", model_dir, "--host", host, *observability_flags(args, served_name), *tls_flags(args)]
    model_len = ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
    template = ["--chat-template", args.chat_template] if args.chat_template else []
    tok = f"{host}:{base + 1}"
    detok = f"{host}:{base + 2}"
    tok_metrics, tok_binds = _metrics_port(base + 1, args, host)
    detok_metrics, detok_binds = _metrics_port(base + 2, args, host)
    specs = [
        ServiceSpec(
            "tokenizer",
            "tokenizer",
            [*common, "--port", str(base + 1), *model_len, *template, *tok_metrics],
            tok,
            binds=[(host, base + 1), *tok_binds],
        ),
        ServiceSpec(
            "detokenizer",
            "detokenizer",
            [*common, "--port", str(base + 2), *detok_metrics],
            detok,
            binds=[(host, base + 2), *detok_binds],
        ),
    ]
    num_prefill = 0 if args.colocated else args.num_prefill
    first_prefill = base + max(10, 3 + args.gateway_workers)
    prefills = [f"{host}:{first_prefill + i}" for i in range(num_prefill)]
    first_decode = first_prefill + max(10, num_prefill)
    decodes = [f"{host}:{first_decode + i}" for i in range(args.num_decode)]
    num_schedulers = len(prefills) + len(decodes)
    env = scheduler_env()
    gpus = scheduler_gpus(args)
    prefill_tp, decode_tp = role_tp_size(args, "prefill"), role_tp_size(args, "decode")
    ranks = len(prefills) * prefill_tp + len(decodes) * decode_tp  # processes that share the devices
    engine = _engine_flags(args, per_device=-(-ranks // len(gpus)) if gpus else num_schedulers)
    engine += forward_lock_flags(args, gpus, num_schedulers, {prefill_tp, decode_tp})
    engine += [
        *model_len,
        "--drain-timeout",
        str(args.drain_timeout),
        "--stats-interval",
        str(args.stats_interval),
    ]
    pin = not (args.max_total_tokens or args.kv_cache_memory)
    for i, addr in enumerate(prefills):
        port = int(addr.rsplit(":", 1)[1])
        metrics, binds = _metrics_port(port, args, host)
        argv = [*common, "--port", str(port), *engine, "--tp-size", str(prefill_tp), *metrics]
        argv += kv_events_flags(args, i)
        gpu = _gpu_env(gpus, i * prefill_tp, prefill_tp)
        specs.append(
            ServiceSpec(
                f"prefill-{i}", "prefill", argv, addr, env | gpu, [(host, port), *binds], pin_kv_pool=pin
            )
        )
    for i, addr in enumerate(decodes):
        port = int(addr.rsplit(":", 1)[1])
        metrics, binds = _metrics_port(port, args, host)
        argv = [*common, "--port", str(port), *engine, "--tp-size", str(decode_tp), *metrics]
        argv += kv_events_flags(args, len(prefills) + i)
        if args.colocated:
            argv.append("--colocated")
        if args.stream_interval != 1:
            argv += ["--stream-interval", str(args.stream_interval)]
        gpu = _gpu_env(gpus, len(prefills) * prefill_tp + i * decode_tp, decode_tp)
        specs.append(
            ServiceSpec(
                f"decode-{i}", "decode", argv, addr, env | gpu, [(host, port), *binds], pin_kv_pool=pin
            )
        )
    gateway_metrics, gateway_binds = _metrics_port(base + 3, args, host)
    gateway = [
        "--model", model_dir,
        "--host", args.host,
        "--port", str(args.port),
        "--grpc-port", str(args.grpc_port),
        "--internal-host", host,
        "--internal-grpc-port", str(base + 3),
        *observability_flags(args, served_name),
        *gateway_metrics,
        *tls_flags(args),
        "--tokenizer-addresses", tok,
        "--detokenizer-addresses", detok,
        "--decode-addresses", ",".join(decodes),
        "--prefill-addresses", ",".join(prefills),
        "--router-policy", args.router_policy,
        "--drain-timeout", str(args.drain_timeout),
    ]  # fmt: skip
    if args.public_client_ca:
        gateway += ["--public-client-ca", args.public_client_ca]
    gateway += lora_modules_flag(args)
    for flag in ("tool_call_parser", "reasoning_parser"):
        if getattr(args, flag, None):
            gateway += ["--" + flag.replace("_", "-"), getattr(args, flag)]
    if args.gateway_workers > 1:
        gateway += ["--workers", str(args.gateway_workers)]
    secrets = {"PDSERVE_API_KEY": args.api_key} if args.api_key else {}
    health = f"{'https' if args.tls_cert else 'http'}://{args.host}:{args.port}/health"
    binds = [(args.host, args.port), (args.host, args.grpc_port)]
    binds += [(host, base + 3 + i) for i in range(args.gateway_workers)]
    binds += [(h, port + i) for h, port in gateway_binds for i in range(args.gateway_workers)]
    # its internal gRPC server: same event loop, the internal plane's TLS; with --gateway-workers the
    # gateway's own supervisor watches each worker's (``gateway.processes``)
    liveness = f"{host}:{base + 3}" if args.gateway_workers == 1 else ""
    specs.append(ServiceSpec("gateway", "gateway", gateway, health, secrets, binds, liveness=liveness))
    return specs
