"""Run-time LoRA adapters: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's
endpoints and bodies), broadcast to every scheduler worker.

A load reaches the prefill workers, then the decode workers (a decode worker that serves the name
finds it on the prefill workers it sends to); an unload goes the other way. Only once every worker
took the change does the gateway's list of names (/v1/models, the ``model`` check) change. A worker
that refuses mid-broadcast has the change undone on the workers that took it, so no worker is left
half-changed, and the error names the worker. One change runs at a time, and runs to its end even
when its caller goes away (a gRPC call cancelled or past its deadline): stopped mid-broadcast, it
would leave workers holding an adapter under a name the gateway no longer knows.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.lora.limits import lora_name_error
from pdserve.sampling.bounds import MAX_LORA_NAME_CHARS, MAX_LORA_PATH_CHARS
from pdserve.services.gateway.errors import GatewayError
from pdserve.services.gateway.openai.serving_common import ServingContext
from pdserve.services.gateway.routing.workers import WorkerPool
from pdserve.services.gateway.transport.backend_clients import BackendClients

logger = logging.getLogger(__name__)

LoraName = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body: the adapter's name (the ``model`` requests use: printable, no whitespace,
    ``pdserve.lora.limits``) and its PEFT directory on the workers' filesystem."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = LoraName
    lora_path: str = Field(min_length=1, max_length=MAX_LORA_PATH_CHARS)

    @field_validator("lora_name")
    @classmethod
    def _printable(cls, name: str) -> str:
        error = lora_name_error(name)
        if error:
            raise ValueError(error)
        return name


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = LoraName


Role = Literal["prefill", "decode"]


class LoraAdmin:
    """Loads and unloads adapters on every worker of ``pools`` (prefill, decode) and keeps
    ``ctx.lora_names`` in step. ``paths``: each served adapter's directory (``--lora-modules``), to
    load one back where an unload is undone. ``refusal``: why this gateway cannot change its names
    (several gateway processes each keep a list of their own), answered with 400."""

    def __init__(
        self,
        ctx: ServingContext,
        clients: BackendClients,
        pools: dict[Role, WorkerPool],
        paths: dict[str, str],
        refusal: str = "",
    ) -> None:
        self.ctx, self.clients, self.pools, self.paths = ctx, clients, pools, dict(paths)
        self.refusal = refusal
        self._lock = asyncio.Lock()
        self._changes: set[asyncio.Task] = set()  # the running changes (asyncio keeps weak refs)

    def _check_allowed(self) -> None:
        if self.refusal:
            raise GatewayError(400, self.refusal)

    def _workers(self, roles: tuple[Role, ...]) -> list[tuple[Role, str]]:
        return [(role, w.address) for role in roles for w in self.pools[role].workers]

    async def _whole(self, change: Coroutine[Any, Any, str]) -> str:
        """Run ``change`` to its end even if this caller is cancelled; its result."""
        task = asyncio.ensure_future(change)
        self._changes.add(task)
        task.add_done_callback(self._finished)
        return await asyncio.shield(task)

    def _finished(self, task: asyncio.Task) -> None:
        self._changes.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a refusal whose caller went away is not an error here

    async def load(self, body: LoadLoraAdapterRequest) -> str:
        """Load ``body``'s adapter on every worker, then serve its name; a confirmation line.

        Raises:
            GatewayError: 400 with a ``refusal``; 409 for a name already served (an adapter or the
                base model's); a worker's refusal (400 without LoRA or for a bad adapter, 429 with
                ``--max-loaded-loras`` adapters loaded, ...) naming the worker.
        """
        self._check_allowed()
        return await self._whole(self._load(body.lora_name, body.lora_path))

    async def _load(self, name: str, path: str) -> str:
        async with self._lock:
            if name in self.ctx.lora_names or name in self.ctx.model_names:
                raise GatewayError(409, f"the model name {name!r} is already served", param="lora_name")
            done: list[tuple[Role, str]] = []
            for role, address in self._workers(("prefill", "decode")):
                try:
                    await self.clients.load_lora_adapter(role, address, name, path)
                except GatewayError as e:
                    await self._undo(done, lambda r, a: self.clients.unload_lora_adapter(r, a, name))
                    raise _naming(e, role, address, undone=bool(done)) from e
                done.append((role, address))
            self.ctx.lora_names.append(name)
            self.paths[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: UnloadLoraAdapterRequest) -> str:
        """Stop serving the adapter, then unload it from every worker; a confirmation line.

        Raises:
            GatewayError: 400 with a ``refusal``; 404 ``model_not_found`` for a name not served as
                an adapter; 409 while requests use it on a worker (naming it).
        """
        self._check_allowed()
        return await self._whole(self._unload(body.lora_name))

    async def _unload(self, name: str) -> str:
        async with self._lock:
            if name not in self.ctx.lora_names:
                raise GatewayError(
                    404, f"no LoRA adapter {name!r} is loaded", param="lora_name", code="model_not_found"
                )
            path = self.paths[name]
            done: list[tuple[Role, str]] = []
            for role, address in self._workers(("decode", "prefill")):
                try:
                    await self.clients.unload_lora_adapter(role, address, name)
                except GatewayError as e:
                    await self._undo(done, lambda r, a: self.clients.load_lora_adapter(r, a, name, path))
                    raise _naming(e, role, address, undone=bool(done)) from e
                done.append((role, address))
            self.ctx.lora_names.remove(name)
            del self.paths[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def _undo(self, done: list[tuple[Role, str]], undo) -> None:
        """Undo a change on the workers that took it, last first; a worker that fails to undo it is
        logged (it holds the change until it restarts or the change is made again)."""
        for role, address in reversed(done):
            try:
                await undo(role, address)
            except GatewayError as e:
                logger.error("could not undo a LoRA change on %s-scheduler %s: %s", role, address, e.message)


def _naming(err: GatewayError, role: Role, address: str, undone: bool) -> GatewayError:
    """``err`` with the worker that raised it in its message, and, where workers before it had taken
    the change (``undone``), that it was undone on them."""
    where = f"{role}-scheduler {address}"
    message = err.message if where in err.message else f"{where}: {err.message}"
    if undone:
        message = f"{message} (undone on the workers that had taken it)"
    return GatewayError(err.status, message, param=err.param, code=err.code, headers=err.headers)
