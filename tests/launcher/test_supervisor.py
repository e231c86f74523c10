"""The Supervisor with a real (light) service: start-up failures, crash restarts with backoff, stopping."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import signal
import time

import psutil
import pytest

from pdserve.model_source import resolve_model
from pdserve.rpc.server import wait_for_health
from pdserve.services.common.supervision.console import Console
from pdserve.services.common.supervision.spec import ServiceSpec
from pdserve.services.common.supervision.supervisor import Supervisor
from tests.stack import free_port_block


def tokenizer_spec(*extra: str) -> ServiceSpec:
    port = free_port_block(1)
    argv = ["--model", str(resolve_model()), "--host", "127.0.0.1", "--port", str(port), *extra]
    return ServiceSpec("tokenizer", "tokenizer", argv, f"127.0.0.1:{port}")


async def test_a_service_that_exits_while_starting_is_named_with_its_output() -> None:
    out = io.StringIO()
    supervisor = Supervisor([tokenizer_spec("--no-such-flag")], Console(out), startup_timeout=120)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tokenizer exited with code 2 while starting") as failure:
        await supervisor.start_all()
    assert time.monotonic() - t0 < 60  # failed fast, not after startup_timeout
    assert "unrecognized arguments: --no-such-flag" in str(failure.value)
    assert "tokenizer | " in out.getvalue()  # its output was relayed, prefixed with its name
    await supervisor.stop_all()


async def test_a_crashed_service_is_restarted_and_everything_stops_at_the_end(caplog) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.launch")
    spec = tokenizer_spec()
    out = io.StringIO()
    supervisor = Supervisor([spec], Console(out), startup_timeout=300, grace=10)
    stop = asyncio.Event()
    try:
        await supervisor.start_all()
        assert "[1/1] tokenizer ready" in out.getvalue()
        supervising = asyncio.ensure_future(supervisor.supervise(stop))
        first = supervisor.children["tokenizer"]
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while "tokenizer is back" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text[-3000:]
            await asyncio.sleep(0.2)
        second = supervisor.children["tokenizer"]
        assert second.pid != first.pid and second.returncode is None
        assert supervisor.restarts == {"tokenizer": 1}
        assert await wait_for_health(spec.health, 10)
        assert f"tokenizer (pid {first.pid}) killed by SIGKILL" in caplog.text
        assert "restarting it in 1 s (restart #1)" in caplog.text
    finally:
        stop.set()
        await supervisor.stop_all()
    await supervising
    assert second.returncode == -signal.SIGTERM or second.returncode == 0
    assert "while stopping" not in caplog.text  # it stopped cleanly, so no warning
    assert not psutil.pid_exists(second.pid) or psutil.Process(second.pid).status() == psutil.STATUS_ZOMBIE


async def test_a_hung_service_is_killed_and_restarted(caplog) -> None:
    """A stopped process (SIGSTOP: it holds its port but answers nothing) fails its liveness check."""
    caplog.set_level(logging.INFO, logger="pdserve.launch")
    liveness_timeout = 2.0
    supervisor = Supervisor([tokenizer_spec()], Console(io.StringIO()), liveness_timeout=liveness_timeout)
    stop = asyncio.Event()
    try:
        await supervisor.start_all()
        supervising = asyncio.ensure_future(supervisor.supervise(stop))
        hung = supervisor.children["tokenizer"]
        await asyncio.sleep(2 * liveness_timeout)  # answering: left alone
        assert supervisor.restarts == {} and hung.returncode is None
        os.kill(hung.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        assert await asyncio.wait_for(hung.wait(), 30) == -signal.SIGKILL
        killed_after = time.monotonic() - t0
        assert liveness_timeout - 0.5 <= killed_after <= 1.5 * liveness_timeout + 3, killed_after
        deadline = time.monotonic() + 300
        while "tokenizer is back" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text[-3000:]
            await asyncio.sleep(0.2)
        assert supervisor.children["tokenizer"].pid != hung.pid and supervisor.restarts == {"tokenizer": 1}
        assert f"tokenizer (pid {hung.pid}) did not answer its liveness check for" in caplog.text
        print(f"SIGSTOPped tokenizer killed {killed_after:.1f} s later, then restarted")
    finally:
        stop.set()
        await supervisor.stop_all()
    await supervising
