"""``GrammarProbe``: every new grammar compiles first in a child process that can be killed.

xgrammar cannot stop a compile midway, and a compile's cost grows much faster than the grammar's
text: the regex ``"(a|b)" * 8000`` (40 KB) takes 8.5 s and compiles to 60 MB, four times the
pattern of half its length. In the scheduler's process such a compile would hold the one compile
thread (every constrained request behind it waits) and its memory until it ends, and nothing could
end it sooner. In the probe's child it ends at the timeout (SIGKILL; the next compile starts a fresh
child, about 2 s) or when the child outgrows its address-space bound (xgrammar's
``std::bad_alloc``). A grammar the probe compiled within both bounds is then compiled again in the
scheduler's process, at about the same cost: shipping the compiled grammar back would cost more
(xgrammar's ``serialize_json`` turns a 16 MB grammar compiled in 0.5 s into 260 MB of JSON in 15 s).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import resource
import signal
import sys
from multiprocessing.connection import Connection

from pdserve.constrained.compile import CompilerUnavailable, GrammarError, compile_checked, too_slow
from pdserve.constrained.spec import GrammarSpec
from pdserve.parent_death import die_with_parent

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # the child imports xgrammar (and torch): ~2 s on an idle machine


class GrammarProbe:
    """A child process (``spawn``) that compiles grammars one at a time, with every check of
    ``compile_checked``, under a time and a memory bound.

    Args:
        tokenizer_info: ``xgr.TokenizerInfo.serialize_json()`` of the model's tokenizer (~1.6 MB
            for a 49k vocabulary), so the child analyses no vocabulary of its own.
        vocab_size: the width of the model's logits.
        timeout_s: seconds one compile may run before the child is killed.
        memory_bytes: bytes of address space the child may add while it compiles (``RLIMIT_AS``
            set above its size once xgrammar is loaded; Linux only).

    ``start`` and ``check`` are meant for one thread (the grammar backend's worker); ``close`` may
    come from any thread, and fails a ``check`` in progress.
    """

    def __init__(self, tokenizer_info: str, vocab_size: int, timeout_s: float, memory_bytes: int) -> None:
        self._args = (tokenizer_info, vocab_size, memory_bytes)
        self.timeout_s = timeout_s
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._closed = False

    def start(self) -> None:
        """Start the child unless it runs (blocks until it is ready).

        Raises:
            RuntimeError: the probe was closed, or its child did not start within ``START_TIMEOUT_S``.
        """
        if self._closed:
            raise RuntimeError("the grammar backend is closed")
        if self._process is not None and self._process.is_alive():
            return
        if self._process is not None:  # died while idle (killed from outside): reap it, close its pipe
            self._stop()
        context = multiprocessing.get_context("spawn")  # a fork of this threaded process could hang
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child_conn, os.getpid(), *self._args), name="grammar-probe", daemon=True
        )
        self._process.start()
        child_conn.close()
        if not self._reply_within(START_TIMEOUT_S):
            self._stop()
            raise RuntimeError(f"the grammar compiler process did not start within {START_TIMEOUT_S:g} s")
        self._conn.recv()

    def check(self, spec: GrammarSpec) -> None:
        """Compile ``spec`` in the child (starting it if needed) and wait at most ``timeout_s``.

        Raises:
            GrammarError: xgrammar refused ``spec`` or its language is empty (the reason from
                ``compile_checked``), its compile ran past ``timeout_s`` (the child is killed), needed
                more than ``memory_bytes``, or crashed the child (a signal of its own, an exit).
            CompilerUnavailable: the child was killed by SIGKILL or SIGTERM from outside meanwhile.
            RuntimeError: as ``start``.
        """
        self.start()
        self._conn.send((spec.kind, spec.text))
        if not self._reply_within(self.timeout_s):
            logger.warning("a %s compile ran past %g s: killed it", spec.kind, self.timeout_s)
            self._stop()
            raise GrammarError(too_slow(self.timeout_s))
        try:
            reason = self._conn.recv()
        except (EOFError, OSError):  # the child died (or ``close`` killed it)
            process = self._process
            self._stop()
            code = process.exitcode
            if code in (-signal.SIGKILL, -signal.SIGTERM):
                name = signal.Signals(-code).name
                raise CompilerUnavailable(
                    f"the grammar compiler was killed ({name}) while compiling it; retry"
                ) from None
            raise GrammarError(
                f"invalid {spec.kind}: the grammar compiler failed on it (exit code {code})"
            ) from None
        if reason is not None:
            raise GrammarError(reason)

    def close(self) -> None:
        """Kill the child; later calls of ``start`` and ``check`` raise."""
        self._closed = True
        process = self._process
        if process is not None and process.is_alive():
            process.kill()

    def _reply_within(self, timeout_s: float) -> bool:
        """Whether the child answered (or ended) within ``timeout_s`` seconds."""
        try:
            return self._conn.poll(timeout_s)
        except (EOFError, OSError):  # closed meanwhile
            return True

    def _stop(self) -> None:
        self._process.kill()
        self._process.join()
        self._conn.close()
        self._process = self._conn = None


def _serve(
    conn: Connection, parent_pid: int, tokenizer_info: str, vocab_size: int, memory_bytes: int
) -> None:
    """The child: answer each ``(kind, text)`` with None (it compiles) or the reason it does not,
    until the scheduler's process closes its end or dies (mid-compile too: the parent-death signal)."""
    if sys.platform == "linux":
        die_with_parent(parent_pid)()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the service, which kills us
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo.deserialize_json(tokenizer_info), max_threads=1, cache_enabled=False
    )
    _bound_address_space(memory_bytes)
    conn.send(None)
    while True:
        try:
            kind, text = conn.recv()
        except EOFError:
            return
        try:
            compile_checked(compiler, GrammarSpec(kind, text), vocab_size)
            conn.send(None)
        except GrammarError as e:
            conn.send(str(e))
        except MemoryError:
            conn.send(f"invalid {kind}: compiling it needs more than {memory_bytes / (1 << 20):g} MiB")


def _bound_address_space(extra_bytes: int) -> None:
    """Let this process's address space grow by at most ``extra_bytes`` from its size now (Linux)."""
    if sys.platform != "linux":
        return
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + extra_bytes
    resource.setrlimit(
        resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard)
    )
