"""The LoRA calls both scheduler roles serve (``LoadLoraAdapter``, ``UnloadLoraAdapter``: vLLM's
run-time adapter loading), as functions their servicers delegate to.

Each change runs on the scheduler thread at the loop's next input point (``SchedulerLoop.call``),
between two steps, so no batch is half-built around it. An unloaded adapter's cached KV is freed
from the radix cache: an adapter loaded later under the same name must not read it.
"""

from __future__ import annotations

from typing import Any

import grpc

from pdserve.lora.adapter import LoraAdapterError
from pdserve.lora.limits import lora_name_error
from pdserve.lora.manager import LoraInUseError, LoraLimitError, LoraManager, LoraNotFoundError
from pdserve.sampling.bounds import MAX_LORA_PATH_CHARS
from pdserve.scheduler.scheduler import Scheduler
from pdserve.services.common import convert
from pdserve.services.common.scheduler_loop import SchedulerLoop


class LoraCallError(Exception):
    """A refused load or unload: the gRPC ``code`` and its message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _manager(scheduler: Scheduler) -> LoraManager:
    manager = scheduler.runner.lora_manager
    if manager is None:
        raise LoraCallError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "LoRA is not enabled on this server: start it with --enable-lora (or --lora-modules)",
        )
    return manager


def load_adapter(scheduler: Scheduler, name: str, path: str) -> None:
    """Add the PEFT adapter at ``path`` (on this worker's filesystem) as ``name``.

    Raises:
        LoraCallError: FAILED_PRECONDITION without LoRA, INVALID_ARGUMENT for a name or path out of
            bounds (a name: ``lora_name_error``) or an adapter that does not fit the base
            (``LoraAdapterError``), ALREADY_EXISTS for a name already served, RESOURCE_EXHAUSTED
            with ``--max-loaded-loras`` adapters loaded (``LoraLimitError``, before any read:
            nothing changes).
    """
    manager = _manager(scheduler)
    name_error = lora_name_error(name)
    if name_error:
        raise LoraCallError(grpc.StatusCode.INVALID_ARGUMENT, f"lora_name: {name_error}")
    if not 0 < len(path) <= MAX_LORA_PATH_CHARS:
        raise LoraCallError(
            grpc.StatusCode.INVALID_ARGUMENT, f"lora_path must have 1 to {MAX_LORA_PATH_CHARS} characters"
        )
    if name in manager.adapters:
        raise LoraCallError(grpc.StatusCode.ALREADY_EXISTS, f"LoRA adapter {name!r} is already loaded")
    try:
        manager.add(name, path)
    except LoraLimitError as e:
        raise LoraCallError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from e
    except LoraAdapterError as e:
        raise LoraCallError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e


def unload_adapter(scheduler: Scheduler, name: str) -> None:
    """Remove adapter ``name`` and free its cached KV.

    Raises:
        LoraCallError: FAILED_PRECONDITION without LoRA, NOT_FOUND for an unknown name, ABORTED
            while requests held here (queued or running) use it.
    """
    manager = _manager(scheduler)
    users = sum(req.sampling_params.lora_name == name for req in scheduler.reqs.values())
    if users:  # queued requests too (the manager counts only the admitted ones)
        raise LoraCallError(grpc.StatusCode.ABORTED, f"LoRA adapter {name!r} is in use by {users} request(s)")
    try:
        manager.remove(name)
    except LoraNotFoundError as e:
        raise LoraCallError(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter {name!r} is loaded") from e
    except LoraInUseError as e:
        raise LoraCallError(grpc.StatusCode.ABORTED, str(e)) from e
    scheduler.ledger.tree.drop_namespace(name)


async def load_lora_adapter(loop: SchedulerLoop, request: Any, context: grpc.aio.ServicerContext) -> Any:
    """``load_adapter`` at the loop's next input point; a refusal aborts the call with its code."""
    return await _serve(loop, context, load_adapter, request.lora_name, request.lora_path)


async def unload_lora_adapter(loop: SchedulerLoop, request: Any, context: grpc.aio.ServicerContext) -> Any:
    """``unload_adapter`` at the loop's next input point; a refusal aborts the call with its code."""
    return await _serve(loop, context, unload_adapter, request.lora_name)


async def _serve(loop: SchedulerLoop, context: grpc.aio.ServicerContext, fn: Any, *args: str) -> Any:
    try:
        await loop.call(fn, *args)
    except LoraCallError as e:
        await context.abort(e.code, str(e))
    return convert.lora_adapter_response_to_pb()
