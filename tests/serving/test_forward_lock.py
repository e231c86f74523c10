"""The forwards' turn among schedulers that share a CPU's cores (``ForwardLock``): one holder at a
time, across processes; a waiter gets the turn when it is released; a holder that keeps it past
``max_wait_s`` costs the others one wait (then they run without it until it is free); a holder's
death releases it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from pdserve.services.common.forward_lock import ForwardLock


@pytest.fixture
def path(tmp_path) -> str:
    return str(tmp_path / "forward.lock")


def test_a_waiter_takes_the_turn_when_the_holder_releases_it(path) -> None:
    a, b = ForwardLock(path), ForwardLock(path)
    order: list[str] = []
    with a.turn():
        waiter = threading.Thread(target=lambda: b._acquire() and order.append("b"))
        started = time.monotonic()
        waiter.start()
        time.sleep(0.2)
        order.append("a done")
    waiter.join(5)
    assert order == ["a done", "b"] and time.monotonic() - started >= 0.2
    assert a._try() is False  # b holds it now
    b.close()  # (which releases it)
    assert a._try() is True
    a.close()


def test_a_stuck_holder_costs_one_wait_then_the_others_run_without_it(path, caplog) -> None:
    holder, other = ForwardLock(path), ForwardLock(path, max_wait_s=0.2, bypass_s=30)
    with holder.turn():
        started = time.monotonic()
        assert other._acquire() is False
        assert time.monotonic() - started >= 0.2
        assert "held the forward lock" in caplog.text
        started = time.monotonic()
        with other.turn():  # bypassing: no second wait
            pass
        assert time.monotonic() - started < 0.1
    assert other._acquire() is True  # free at once: taken, even while bypassing
    other.close()
    holder.close()


def test_a_holder_that_dies_releases_the_turn(path) -> None:
    code = (
        "import sys, time; from pdserve.services.common.forward_lock import ForwardLock;"
        f"lock = ForwardLock({path!r}); lock._acquire(); print('held', flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        waiter = ForwardLock(path, max_wait_s=30)
        done = threading.Event()
        thread = threading.Thread(target=lambda: waiter._acquire() and done.set())
        thread.start()
        assert not done.wait(0.3)  # the child holds it
        child.kill()
        assert done.wait(10)
        thread.join()
        waiter.close()
    finally:
        child.kill()
        child.wait()
