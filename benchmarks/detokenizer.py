"""Detokenization throughput: 256 concurrent streams of real SmolLM2 token ids turned into text.

``python -m benchmarks.detokenizer [--streams 256] [--tokens 256] [--no-grpc] [--stops-at-bounds]``

lib:  IncrementalDetokenizer.step on one BatchTokenIDOutput's worth per decode step (one new id per
      stream per step, half the streams with stop strings that never match, so hold-back runs).
      ``--stops-at-bounds``: those streams carry the worst stop strings the request bounds allow
      (``pdserve.sampling.bounds``: 1,024 characters in all, 255 spaces and a character that never
      comes, so every prefix is tried after each space).
grpc: the same steps as BatchTokenIDOutput messages streamed by a decode-scheduler-style client into
      a detokenizer process, text collected by a GatewayOutput servicer here; timed from the first
      send to the last final output received.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time

import grpc

from pdserve.detokenize import DecodeOptions, IncrementalDetokenizer, TokenStep
from pdserve.rpc.client_stream import ClientStreamSender
from pdserve.rpc.server import GrpcServer, wait_for_health
from pdserve.sampling.bounds import MAX_STOP_STRING_CHARS, MAX_STOP_TOTAL_CHARS
from pdserve.tokenization import Tokenizer
from pdserve.v1 import common_pb2, output_pb2, output_pb2_grpc
from tests.stack import free_port_block

WORDS = [
    *("the", "model", "serves", "many", "requests", "at", "once", "while", "and", "tokens", "stream"),
    *("你好", "世界", "缓存", "😀", "🚀", "naïve", "café"),
]
STOPS = ("\n\nUser:", "###")
WORST_STOPS = tuple(
    " " * (MAX_STOP_STRING_CHARS - 1) + chr(0x2400 + i)
    for i in range(MAX_STOP_TOTAL_CHARS // MAX_STOP_STRING_CHARS)
)


def token_streams(tokenizer: Tokenizer, streams: int, tokens: int) -> list[list[int]]:
    """``streams`` different id sequences of ``tokens`` ids each, cut from one long mixed-script text."""
    rng = random.Random(0)
    text = " ".join(rng.choice(WORDS) for _ in range(4 * tokens + 8 * streams))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= tokens + 7 * streams, "corpus too short"
    return [ids[7 * k : 7 * k + tokens] for k in range(streams)]


def options(k: int, stops: tuple[str, ...] = STOPS) -> DecodeOptions:
    return DecodeOptions(stop=stops if k % 2 else ())


def bench_lib(tokenizer: Tokenizer, streams: list[list[int]], stops: tuple[str, ...]) -> dict[str, float]:
    detok = IncrementalDetokenizer(tokenizer)
    steps = len(streams[0])
    latencies = []
    chars = 0
    for step in range(steps):
        batch = [
            TokenStep(f"r{k}", [ids[step]], step == steps - 1, options(k, stops) if step == 0 else None)
            for k, ids in enumerate(streams)
        ]
        t0 = time.perf_counter()
        deltas = detok.step(batch)
        latencies.append(time.perf_counter() - t0)
        chars += sum(len(d.text) for d in deltas if d is not None)
    total = sum(latencies)
    return {
        "tokens_per_s": len(streams) * steps / total,
        "step_p50_ms": 1e3 * statistics.median(latencies),
        "step_p99_ms": 1e3 * statistics.quantiles(latencies, n=100)[98],
        "chars": chars,
    }


class Gateway(output_pb2_grpc.GatewayOutputServicer):
    def __init__(self, expected_finished: int) -> None:
        self.finished = 0
        self.chars = 0
        self.expected = expected_finished
        self.done = asyncio.Event()

    async def StreamStrOutputs(self, request_iterator, context) -> output_pb2.StreamAck:
        async for batch in request_iterator:
            for out in batch.outputs:
                self.chars += len(out.text_delta)
                self.finished += out.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
            self.chars += sum(len(text) for text in batch.text_deltas)
            if self.finished >= self.expected:
                self.done.set()
        return output_pb2.StreamAck()


def step_messages(
    streams: list[list[int]], gateway: str, stops: tuple[str, ...]
) -> list[output_pb2.BatchTokenIDOutput]:
    """One BatchTokenIDOutput per step, as a decode worker sends them: the first and last outputs of
    each stream as rows of their own, every step between as columns."""
    steps = len(streams[0])
    batches = []
    for step in range(steps):
        if 0 < step < steps - 1:
            batches.append(
                output_pb2.BatchTokenIDOutput(
                    rids=[f"r{k}" for k in range(len(streams))],
                    num_token_ids=[1] * len(streams),
                    token_ids=[ids[step] for ids in streams],
                    completion_tokens=[step + 1] * len(streams),
                )
            )
            continue
        batch = output_pb2.BatchTokenIDOutput()
        for k, ids in enumerate(streams):
            out = batch.outputs.add(rid=f"r{k}", token_ids=[ids[step]], completion_tokens=step + 1)
            if step == steps - 1:
                out.finish_reason = common_pb2.FINISH_REASON_LENGTH
            if step == 0:
                out.gateway_address = gateway
                out.skip_special_tokens = True
                out.stop.extend(options(k, stops).stop)
        batches.append(batch)
    return batches


async def bench_grpc(model: str | None, streams: list[list[int]], stops: tuple[str, ...]) -> dict[str, float]:
    port = free_port_block(1)
    cmd = [sys.executable, "-m", "pdserve.services.detokenizer.main", "--port", str(port)]
    proc = subprocess.Popen([*cmd, *(["--model", model] if model else [])], stderr=subprocess.DEVNULL)
    gateway = Gateway(len(streams))
    server = GrpcServer("127.0.0.1:0", [])
    server.add(output_pb2_grpc.add_GatewayOutputServicer_to_server, gateway)
    await server.start()
    try:
        address = f"127.0.0.1:{port}"
        if not await wait_for_health(address, timeout=120):
            raise RuntimeError("detokenizer did not become healthy")
        messages = step_messages(streams, server.address, stops)
        sender = ClientStreamSender(address, lambda ch: output_pb2_grpc.DetokenizerStub(ch).StreamTokenIDs)
        t0 = time.perf_counter()
        for msg in messages:
            sender.send(msg)
        await asyncio.wait_for(gateway.done.wait(), timeout=300)
        elapsed = time.perf_counter() - t0
        await sender.close()
        async with grpc.aio.insecure_channel(address) as channel:
            metrics = await output_pb2_grpc.DetokenizerStub(channel).GetMetrics(common_pb2.MetricsRequest())
        assert "pdserve:detokenizer_active_streams 0.0" in metrics.text
        return {
            "tokens_per_s": len(streams) * len(streams[0]) / elapsed,
            "seconds": elapsed,
            "chars": gateway.chars,
        }
    finally:
        proc.terminate()
        proc.wait()
        await server.stop(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256, help="ids per stream")
    parser.add_argument("--no-grpc", action="store_true", help="library path only")
    parser.add_argument("--stops-at-bounds", action="store_true", help="worst stop strings allowed")
    args = parser.parse_args(argv)

    tokenizer = Tokenizer.load(args.model)
    streams = token_streams(tokenizer, args.streams, args.tokens)
    stops = WORST_STOPS if args.stops_at_bounds else STOPS
    lib = bench_lib(tokenizer, streams, stops)
    result = {
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "stops_at_bounds": args.stops_at_bounds,
        "lib": lib,
    }
    if not args.no_grpc:
        result["grpc"] = asyncio.run(bench_grpc(args.model, streams, stops))

    print(f"{'path':<6} {'tokens/s':>12} {'step p50 ms':>12} {'step p99 ms':>12}")
    print(f"{'lib':<6} {lib['tokens_per_s']:>12,.0f} {lib['step_p50_ms']:>12.2f} {lib['step_p99_ms']:>12.2f}")
    if "grpc" in result:
        print(f"{'grpc':<6} {result['grpc']['tokens_per_s']:>12,.0f} {'':>12} {'':>12}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
