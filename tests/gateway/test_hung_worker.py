"""A hung worker (SIGSTOPped, or its machine gone quiet) as the gateway sees it: connections that
stay open and hear nothing. Health probes of it time out; requests routed to it before it is taken
out end then, with a retryable 503, instead of waiting for their ``DecodeScheduler.Generate`` call's
30 s deadline (found by a hostile-client run: requests sent to a stopped decode worker hung 17-39 s)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import openai
import pytest

from pdserve.services.gateway.main import Gateway, parse_args
from pdserve.services.gateway.routing.router import Router
from pdserve.services.gateway.routing.worker_monitor import WorkerMonitor
from pdserve.services.gateway.routing.workers import WorkerPool
from pdserve.services.gateway.transport.backend_clients import BackendClients
from pdserve.services.gateway.transport.convert import SCHEDULER_SERVICES
from tests.gateway.conftest import API_KEY
from tests.stack import free_port_block

PROBE_TIMEOUT_S = 2.0  # BackendClients' default
INTERVAL_S = 0.2


# a process that serves grpc.health.v1 (SERVING, for the decode-scheduler's service too) until stopped
SERVING = """
import asyncio, sys
from pdserve.rpc.server import GrpcServer

async def main():
    server = GrpcServer(sys.argv[1], [sys.argv[2]])
    await server.start()
    await server.set_serving(True)
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@contextlib.contextmanager
def hung_port() -> Iterator[str]:
    """An address whose TCP connections complete (the listen backlog) and then hear nothing."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@contextlib.contextmanager
def serving_process() -> Iterator[subprocess.Popen]:
    """A real gRPC server process (its address in ``.args[-2]``) answering health checks SERVING."""
    address = f"127.0.0.1:{free_port_block(1)}"
    command = [sys.executable, "-c", SERVING, address, SCHEDULER_SERVICES["decode"]]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


async def test_a_hung_scheduler_costs_one_probe_timeout_and_is_not_draining(local_gateway) -> None:
    """A scheduler that does not answer is not asked a second time (about the server as a whole, to
    tell draining from down): one probe costs one timeout, and it never counts as draining."""
    with hung_port() as hung:
        pools = {"decode": WorkerPool("decode", [hung]), "prefill": WorkerPool("prefill", [])}
        router = Router(pools["decode"], pools["prefill"], "round_robin")
        clients = BackendClients(probe_timeout=1.0)
        downs: list[tuple[str, str]] = []
        monitor = WorkerMonitor(clients, pools, router, on_down=lambda role, a: downs.append((role, a)))
        try:
            for probe in range(1, 4):
                start = time.monotonic()
                assert await monitor.check_once() == {"decode": {hung: False}}
                assert time.monotonic() - start < 1.5 * clients.probe_timeout
                worker = pools["decode"].workers[0]
                assert not worker.draining and worker.healthy is (probe < 3)
            assert downs == [("decode", hung)]
        finally:
            await clients.close()


async def test_requests_sent_to_a_hung_decode_worker_end_when_it_is_taken_out(local_gateway) -> None:
    """A decode worker (and detokenizer) that answered its probes is SIGSTOPped; three requests sent
    to it then each end with a 503 that says to retry once it is taken out (3 failed probes), well
    before their Generate calls' own deadline; the next request is refused at once."""
    with serving_process() as worker:
        hung = worker.args[-2]
        args = parse_args(
            [
                "--port", "0", "--grpc-port", "0",
                "--tokenizer-addresses", local_gateway.tokenizer_address,
                "--decode-addresses", hung, "--detokenizer-addresses", hung,
                "--health-check-interval", str(INTERVAL_S), "--api-key", API_KEY, "--log-level", "warning",
            ]
        )  # fmt: skip
        gateway = Gateway(args)
        await gateway.start()
        status = await gateway.monitor.check_once()
        assert status["decode"] == status["detokenizer"] == {hung: True}
        worker.send_signal(signal.SIGSTOP)
        api = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key=API_KEY, max_retries=0, timeout=60
        )

        async def ask() -> tuple[float, openai.APIStatusError]:
            start = time.monotonic()
            with pytest.raises(openai.APIStatusError) as failed:
                await api.chat.completions.create(
                    model=args.model_names[0], messages=[{"role": "user", "content": "Hi"}], max_tokens=4
                )
            return time.monotonic() - start, failed.value

        try:
            # sent while the worker still counts as healthy: each waits on its Generate call
            answers = await asyncio.gather(*(ask() for _ in range(3)))
            takeout = 3 * (PROBE_TIMEOUT_S + INTERVAL_S)
            for seconds, error in answers:
                assert error.status_code == 503 and "went down or restarted; retry" in error.message, error
                assert seconds < takeout + 2.0 < gateway.clients.rpc_timeout, seconds
            seconds, error = await ask()
            assert error.status_code == 503 and "no healthy" in error.message, error
            assert seconds < 1.0
            assert not gateway.manager.handles and gateway.manager.pending_choices == 0
        finally:
            await api.close()
            await gateway.stop()
