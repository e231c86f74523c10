"""Engine and scheduling flags shared by ``pdserve prefill`` and ``pdserve decode``."""

from __future__ import annotations

import argparse

from pdserve.cli_args import add_model_arg, add_quantization_arg, add_server_args


def add_scheduler_args(parser: argparse.ArgumentParser, port: int) -> None:
    add_server_args(parser, port)
    add_model_arg(parser)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    add_quantization_arg(parser)
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens")
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool size in bytes")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch_native", "flashinfer"])
    parser.add_argument("--device", default="auto", help="auto (CUDA when there is a GPU), cpu or cuda[:i]")
    parser.add_argument("--disable-cuda-graph", action="store_true", help="on CUDA, decode without graphs")
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--chunked-prefill-size", type=int, default=512, help="tokens extended per step")
    parser.add_argument("--schedule-policy", default="fcfs", choices=["fcfs", "lpm"])
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument("--worker-id", default=None, help="name in metrics and logs (default: host:port)")
