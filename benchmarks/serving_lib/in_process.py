"""The scheduler of a colocated pdserve driven in this process: no gRPC, HTTP, tokenizer or detokenizer.

:meth:`InProcessServer.from_launch_flags` builds exactly the engine and scheduler core that
``pdserve launch FLAGS --colocated`` gives its decode worker: the launcher's own option parsing and
topology turn ``FLAGS`` into that worker's command line, the decode service's parser reads it, and
the services' bootstrap builds the scheduler (role ``mixed``). The scheduler runs under the same
``SchedulerLoop`` the decode service runs (schedule on the event loop, forward on one worker
thread). Requests go in as token ids; each step's tokens come back through the loop's
``on_outputs`` callback and are timed there, as the HTTP client times streamed chunks, into the
same :class:`~benchmarks.serving_lib.stats.RequestRecord`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.serving_lib.stats import RequestRecord
from pdserve.model_source import resolve_model
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.req import Req, ReqState
from pdserve.scheduler.scheduler import Scheduler, StepOutput
from pdserve.services.common.bootstrap import build_scheduler, overlap_schedule
from pdserve.services.common.scheduler_loop import SchedulerLoop
from pdserve.services.decode.main import make_parser as decode_parser
from pdserve.services.launcher.main import parse_args as launch_args
from pdserve.services.launcher.topology import build_topology


@dataclass(slots=True)
class Generation:
    """One finished in-process request: its timings and the token ids it generated."""

    record: RequestRecord
    output_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Stream:
    generation: Generation
    done: asyncio.Future
    last_token: float = 0.0


class InProcessServer:
    """A scheduler core served to coroutines of this process; use it as an async context manager.

    Inside ``async with server:`` the scheduler loop runs on the current event loop and
    :meth:`generate` may be awaited from any number of tasks at once; outside it nothing runs.

    Args:
        scheduler: the scheduler core (role ``mixed``).
        model_dir: the checkpoint directory its weights came from (for the matching tokenizer).
        overlap: run the loop overlapped (``SchedulerLoop``), as the decode service would with the
            same flags (``overlap_schedule``).
    """

    def __init__(self, scheduler: Scheduler, model_dir: Path, overlap: bool = True) -> None:
        self.scheduler = scheduler
        self.model_dir = model_dir
        self.overlap = overlap
        self._rids = itertools.count()
        self._streams: dict[str, _Stream] = {}
        self._loop: SchedulerLoop | None = None
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    @classmethod
    def from_launch_flags(cls, flags: Sequence[str]) -> InProcessServer:
        """The decode worker's scheduler of ``pdserve launch *flags`` (environment and config applied).

        Call it on a short-lived worker thread, as the decode service does
        (``build_scheduler_off_loop``), and let that thread end before the run: while a thread that
        ran OpenMP code lives, its libgomp thread pool does too, and with more libgomp threads than
        CPUs libgomp stops spinning at barriers and sleeps instead (~20% of the step time here).

        Raises:
            ValueError: ``flags`` do not describe one colocated worker (``--colocated``, one decode).
            SystemExit: the launcher rejects ``flags`` (as ``pdserve launch`` would).
        """
        args = launch_args(list(flags))
        if not args.colocated or args.num_decode != 1:
            raise ValueError("the in-process scheduler needs --colocated and one decode worker")
        model_dir = resolve_model(args.model)
        worker = next(s for s in build_topology(args, str(model_dir)) if s.role == "decode")
        worker_args = decode_parser().parse_args(worker.argv)
        scheduler = build_scheduler(worker_args, "mixed")
        return cls(scheduler, model_dir, overlap_schedule(worker_args, scheduler.runner.device))

    async def __aenter__(self) -> InProcessServer:
        self._loop = SchedulerLoop(self.scheduler, self._on_outputs, overlap=self.overlap)
        self._stop = asyncio.Event()  # of the running event loop
        self._task = asyncio.create_task(self._loop.run(self._stop))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        self._loop.wake()
        await self._task
        self._loop = self._stop = self._task = None

    async def generate(self, input_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Run one request to its end; returns its record (errors in ``record.error``, never raised).

        Raises RuntimeError outside ``async with``.
        """
        if self._loop is None:
            raise RuntimeError("InProcessServer.generate needs `async with server:`")
        rid = f"in-process-{next(self._rids)}"
        generation = Generation(RequestRecord(prompt_tokens=len(input_ids), start=time.perf_counter()))
        req = Req(rid, list(input_ids), dataclasses.replace(params))
        try:
            self.scheduler.add_request(req)
        except ValueError as e:
            generation.record.error = f"ValueError: {e}"
            generation.record.end = time.perf_counter()
            return generation
        stream = self._streams[rid] = _Stream(generation, asyncio.get_running_loop().create_future())
        self._loop.wake()
        await stream.done
        return generation

    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        """Called by the loop after every step: time the new tokens, complete the finished requests."""
        now = time.perf_counter()
        for out in outputs:
            stream = self._streams.get(out.req.rid)
            if stream is None:
                continue
            record = stream.generation.record
            if out.new_token_ids:
                if record.ttft is None:
                    record.ttft = now - record.start
                else:
                    record.itl.append(now - stream.last_token)
                stream.last_token = now
            if out.finished:
                del self._streams[out.req.rid]
                record.end = now
                record.output_tokens = len(out.req.output_ids)
                stream.generation.output_ids = list(out.req.output_ids)
                if out.req.state is not ReqState.FINISHED:
                    record.error = f"{out.req.state.value}: {out.req.error}"
                elif record.ttft is None:
                    record.error = "no token was generated"
                stream.done.set_result(None)
