"""The request path of one gateway replica: tokenize, validate, route, send, and abort.

The gateway's share of SGLang's TokenizerManager (``generate_request``): the tokenizer and the
detokenizer are separate services here, so this module holds what is left in the entry process:
admission (``admission``: the pending limit in sub-requests, vocabulary bounds, the context and the
default ``max_new_tokens``), fan-out of ``n`` samples into sub-requests, routing,
``DecodeScheduler.Generate``, and ``Abort`` when a request ends early. Outputs arrive through
``transport.output_servicer.GatewayOutputServicer``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
import time
from collections.abc import Coroutine

from pdserve.sampling.bounds import wrap_int64
from pdserve.services.gateway.errors import (
    GatewayError,
    duplicate_rid,
    retry_after,
)
from pdserve.services.gateway.io_struct import (
    ChatPrompt,
    GenerateReqInput,
    ModelInfo,
    Prompt,
    TokenizedPrompt,
)
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.requests import admission
from pdserve.services.gateway.requests.migration import Migrator
from pdserve.services.gateway.requests.state import ReqState, RequestHandle, RequestRegistry
from pdserve.services.gateway.requests.token_pieces import TokenPieces
from pdserve.services.gateway.routing.router import Router
from pdserve.services.gateway.routing.workers import WorkerPool
from pdserve.services.gateway.transport.backend_clients import BackendClients

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class ManagerConfig:
    """Request-path settings of one replica.

    Attributes:
        gateway_address: this replica's advertised gRPC address (where outputs come back).
        max_pending_requests: sub-requests (prompts × n of each request) in flight before new
            requests get 429 (0 = unlimited; None = sized from the decode workers' KV pools, see
            ``admission``); one that alone has more gets 400.
        request_timeout: seconds from arrival before a request is aborted with 504 (None = none).
        default_max_tokens: cap on the default ``max_new_tokens`` (context length - prompt length).
        log_requests: log one line per client request as it ends (rid, tokens, time, how it ended).
        migration_limit: times a choice may move off a lost decode worker (``migration``).
    """

    gateway_address: str
    max_pending_requests: int | None = None
    request_timeout: float | None = None
    default_max_tokens: int = 4096
    log_requests: bool = False
    migration_limit: int = 3


def backend_rid(rid: str, index: int, tag: str, serial: int) -> str:
    """The rid choice ``index`` of client request ``rid`` carries in the backends:
    ``{rid}-{index}.{tag}.{serial:x}``.

    ``tag`` is the sending replica's (8 random hex digits, drawn at its start) and ``serial`` the
    request's number at that replica, so a client-chosen rid (rids are per API key: two keys may
    use one at once) never equals another request's in a scheduler or a detokenizer, where equal
    rids would refuse one, let its cleanup abort the other, or route one's tokens to the other's
    client. Logs and traces of the backends show it; it starts with ``rid``.
    """
    return f"{rid}-{index}.{tag}.{serial:x}"


class RequestManager:
    """Owns this replica's in-flight requests (rid -> ``RequestHandle``)."""

    def __init__(
        self,
        config: ManagerConfig,
        clients: BackendClients,
        router: Router,
        tokenizers: WorkerPool,
        detokenizers: WorkerPool,
        registry: RequestRegistry,
        metrics: GatewayMetrics,
    ) -> None:
        self.config = config
        self.clients = clients
        self.router = router
        self.tokenizers = tokenizers
        self.detokenizers = detokenizers
        self.registry = registry
        self.metrics = metrics
        self.handles: dict[tuple[str | None, str], RequestHandle] = {}  # (API key, rid) -> handle
        self.rid_tag = secrets.token_hex(4)  # this replica's, in every rid it sends (``backend_rid``)
        self._serials = itertools.count()  # the requests' numbers, in every rid it sends
        self.pending_choices = 0  # sub-requests of the handles in flight
        self.token_pieces = TokenPieces(lambda ids: clients.token_pieces(self.tokenizers.next().address, ids))
        self._model_info: ModelInfo | None = None
        self._background: set[asyncio.Task] = set()
        self.draining = False
        self.migrator = Migrator(
            config.migration_limit, self.handles, router, registry, metrics, self._send, self._abort_choice,
            self._spawn,
        )  # fmt: skip
        metrics.in_flight.set_function(lambda: len(self.handles))

    async def model_info(self) -> ModelInfo:
        """The tokenizer service's ``GetInfo`` (fetched once). Raises ``GatewayError`` (503 when down)."""
        if self._model_info is None:
            self._model_info = await self.clients.model_info(self.tokenizers.next().address)
        return self._model_info

    async def tokenize(self, prompts: list[Prompt], add_special_tokens: bool = True) -> list[TokenizedPrompt]:
        """Token ids of each prompt; token-id prompts pass through, text and chat go to a tokenizer."""
        todo = [p for p in prompts if not isinstance(p, list)]
        address = self.tokenizers.next().address if todo else ""
        if len(todo) == 1:
            done = [await self.clients.tokenize(address, todo[0], add_special_tokens)]
        else:
            done = await self.clients.tokenize_batch(address, todo, add_special_tokens) if todo else []
        it = iter(done)
        return [TokenizedPrompt(list(p)) if isinstance(p, list) else next(it) for p in prompts]

    async def check_token_ids(self, input_ids: list[int]) -> None:
        """400 unless every id of a token-id prompt is in the vocabulary (before it is sent anywhere)."""
        admission.check_ids(input_ids, (await self.model_info()).vocab_size)

    async def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return await self.clients.detokenize(self.tokenizers.next().address, ids, skip_special_tokens)

    async def submit(
        self, obj: GenerateReqInput, timeout: float | None = None, owner: str | None = None
    ) -> RequestHandle:
        """Tokenize, check, route and send every choice of ``obj``; returns the handle to read outputs from.

        Args:
            timeout: seconds until the request's deadline (e.g. a gRPC deadline); the shorter of it
                and ``--request-timeout`` applies.
            owner: the API key the request was sent with (None without API keys): only it can
                ``abort`` the request.

        Raises:
            GatewayError: 429 too many requests in flight (``admission``), 409 rid in flight under
                the same API key (the request in flight goes on; other keys' rids are their own),
                400 prompt too long for the context, 503 no healthy worker or the gateway is
                shutting down, 504 deadline passed, or a backend call's error (429 when a
                scheduler's queue is full). Choices already sent are aborted before it is raised.
        """
        cfg = self.config
        if self.draining:
            raise GatewayError(
                503,
                "the gateway is shutting down; retry (another replica, or this one once restarted)",
                headers=retry_after(),
            )
        admission.check_pending(obj, self.pending_choices, cfg.max_pending_requests, self.router.decode)
        if (owner, obj.rid) in self.handles:
            raise duplicate_rid(obj.rid)
        timeouts = [t for t in (timeout, cfg.request_timeout) if t is not None]
        budget = min(timeouts) if timeouts else None
        handle = RequestHandle(
            rid=obj.rid,
            owner=owner,
            registry=self.registry,
            metrics=self.metrics,
            abort_backend=self._abort_choice,
            on_close=lambda h, choices=obj.num_choices: self._closed(h, choices),
            migrate=self.migrator.migrate,
            deadline=None if budget is None else time.monotonic() + budget,
        )
        self.handles[owner, obj.rid] = handle
        self.pending_choices += obj.num_choices
        try:
            async with asyncio.timeout(budget):
                await self._dispatch(obj, handle, budget)
        except TimeoutError:
            handle.close("deadline")
            raise GatewayError(
                504, f"request {obj.rid} passed its deadline before it was scheduled"
            ) from None
        except BaseException:
            handle.close("failed to dispatch")
            raise
        return handle

    def _closed(self, handle: RequestHandle, choices: int) -> None:
        if self.handles.pop((handle.owner, handle.rid), None) is None:
            return
        self.pending_choices -= choices
        if self.config.log_requests:
            logger.info(
                "request %s ended (%s): %d prompt tokens, %d choices, %.3f s",
                handle.rid, "completed" if handle.completed else handle.close_reason,
                sum(handle.prompt_tokens), len(handle.states),
                time.monotonic() - handle.arrival, extra={"rid": handle.rid},
            )  # fmt: skip

    async def _dispatch(self, obj: GenerateReqInput, handle: RequestHandle, budget: float | None) -> None:
        info = await self.model_info()
        admission.check_sampling(obj, info.vocab_size)
        tokenized = await self.tokenize(obj.prompts, obj.add_special_tokens)
        if handle.abort_reason:  # aborted (public Abort) while it was being tokenized
            raise GatewayError(499, f"request {obj.rid} was aborted: {handle.abort_reason}")
        admission.check_prompt_logprob_positions(obj, [len(p.input_ids) for p in tokenized])
        serial = next(self._serials)
        for j, (given, prompt) in enumerate(zip(obj.prompts, tokenized, strict=True)):
            sp = obj.sampling_params
            param = "messages" if isinstance(given, ChatPrompt) else "input" if sp.embed else "prompt"
            admission.check_ids(prompt.input_ids, info.vocab_size, param)
            admission.check_prompt_logprobs(obj, len(prompt.input_ids), param)
            max_new = admission.max_new_tokens(
                obj, len(prompt.input_ids), info.context_length, self.config.default_max_tokens, param
            )
            handle.prompt_tokens.append(len(prompt.input_ids))
            scorer = None
            for i in range(obj.n):
                index = j * obj.n + i
                seed = None if sp.seed is None else wrap_int64(sp.seed + i)
                scores = sp.prompt_logprobs if i == 0 else None  # sample 0 scores the prompt
                state = ReqState(
                    rid=backend_rid(obj.rid, index, self.rid_tag, serial),
                    index=index,
                    input_ids=prompt.input_ids,
                    sampling_params=dataclasses.replace(
                        sp, max_new_tokens=max_new, seed=seed, prompt_logprobs=scores
                    ),
                    owner=handle,
                )
                handle.add_choice(state)
                if sp.prompt_logprobs is not None and i == 0:
                    scorer = state
                elif scorer is not None:  # (``state``'s module docstring: computed once, copied)
                    state.scorer, state.held = scorer, []
                    scorer.samples.append(state)
        arrival = time.time()
        deadline = 0.0 if budget is None else arrival + budget
        for state in handle.states:
            state.route = self.router.route(state.input_ids, state.sampling_params.lora_name)
        # samples that copy prompt logprobs are sent once their scorer is queued, so that they queue
        # behind it and wait for its prompt KV (the scheduler's in-batch prefix sharing)
        for wave in ([s for s in handle.states if s.scorer is None], [s for s in handle.states if s.scorer]):
            results = await asyncio.gather(
                *(self._send(state, arrival, deadline) for state in wave), return_exceptions=True
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]

    async def _send(self, state: ReqState, arrival: float, deadline: float) -> None:
        """Send one choice to its decode-scheduler; a choice aborted meanwhile is not sent, or is
        aborted again once the scheduler has it (its first abort may have arrived before it). A
        choice the gateway ends while its call is in flight (aborted, or its worker taken out)
        cancels the call (``RequestHandle``): its end is already in the handle, and the request
        waits no longer; so does a choice migrated meanwhile (``migration``: its continuation's
        call replaces this one)."""
        if state.finished:
            return
        rid = state.rid
        state.output_address = self.detokenizers.next().address
        state.sent = True  # the scheduler may admit it even if the ack is lost: abort it on failure
        state.sending = asyncio.ensure_future(self._generate(state, arrival, deadline))
        try:
            await state.sending
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling() or not (state.finished or state.rid != rid):
                raise  # this task was cancelled, not only the call
        except GatewayError as e:
            if state.rid != rid:
                return
            if e.status == 409:  # the scheduler holds another request of this rid and refused this one:
                state.sent = False  # an abort by rid would end that other request
            raise
        finally:
            reason = state.owner.close_reason or state.owner.abort_reason
            if state.rid == rid:
                state.sending = None
                if reason:
                    self._abort_choice(state, reason)

    async def _generate(self, state: ReqState, arrival: float, deadline: float) -> None:
        await self.clients.generate(
            state.route.decode.address,
            state.rid,
            state.input_ids,
            state.sampling_params,
            prefill_address=state.route.prefill_address,
            fallback_prefill_addresses=state.route.fallback_prefill_addresses,
            output_address=state.output_address,
            gateway_address=self.config.gateway_address,
            deadline_unix_s=deadline,
            arrival_unix_s=arrival,
            resumed_output_ids=state.output_ids,
        )

    def abort(self, rid: str, owner: str | None, reason: str = "aborted by client") -> bool:
        """End the request ``rid`` of this replica sent with the API key ``owner`` (every choice,
        finish_reason "abort"); False if there is none: unknown, or another key's (which is not told
        apart, so that a caller learns nothing of other keys' requests)."""
        handle = self.handles.get((owner, rid))
        if handle is None:
            return False
        handle.abort(reason)
        return True

    def _abort_choice(self, state: ReqState, reason: str) -> None:
        """Tell the decode-scheduler to drop ``state`` (in the background: callers may be cancelled)."""
        self._spawn(self._send_abort(state.route.decode.address, state.rid, reason))

    async def _send_abort(self, address: str, rid: str, reason: str) -> None:
        try:
            await self.clients.abort(address, rid, reason)
        except GatewayError as e:
            logger.warning("abort of %s at %s failed: %s", rid, address, e.message, extra={"rid": rid})

    def _spawn(self, coro: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self, timeout: float) -> None:
        """At shutdown: refuse new requests (503) and give those in flight ``timeout`` seconds to
        finish, then abort what is left and wait for the abort calls."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.handles and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for handle in list(self.handles.values()):
            handle.close("gateway shutting down")
        if self._background:
            await asyncio.wait(self._background, timeout=5.0)
