"""DetokenizerServicer: BatchTokenIDOutput streams in, one BatchStrOutput per gateway out."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator

import grpc

from pdserve.detokenize import IncrementalDetokenizer, TokenStep
from pdserve.observability import tracing
from pdserve.rpc.client_stream import DEFAULT_DEAD_AFTER_S, ClientStreamPool
from pdserve.services.detokenizer.convert import (
    Route,
    StrBatchBuilder,
    column_rows,
    is_first_output,
    lost_output,
    to_route,
    to_str_output,
    to_token_step,
)
from pdserve.services.detokenizer.metrics import DetokenizerMetrics
from pdserve.services.detokenizer.scheduler_abort import SchedulerAborter
from pdserve.v1 import common_pb2, output_pb2, output_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = output_pb2.DESCRIPTOR.services_by_name["Detokenizer"].full_name
add_to_server = output_pb2_grpc.add_DetokenizerServicer_to_server


class DetokenizerServicer(output_pb2_grpc.DetokenizerServicer):
    """Owns the per-rid decode states and the routes of their outputs.

    Args:
        detokenizer: the batched incremental detokenizer (holds ``DecodeStatus`` per rid).
        worker: this process's address, reported in ``GetMetrics``.
        gateway_dead_after: seconds a gateway may stay unreachable before it counts as gone.
        model_name: the served model name (the ``model_name`` label of its metrics).

    A rid's state opens on its first TokenIDOutput (which carries gateway and scheduler addresses
    and decode options) and is dropped when it finishes: by the scheduler (EOS, length, abort and
    error pass through with their error text) or by a stop string, in which case this servicer
    sends the STOP output and calls ``DecodeScheduler.Abort(rid, reason="stop")`` with finish reason
    STOP (the scheduler counts it as a stop, not an abort) so generation ends within a step. Ids
    that still arrive for a finished rid are ignored.

    A gateway replica that is gone (its output stream cannot reconnect for ``gateway_dead_after``
    seconds) owns no client any more: every rid routed to it is aborted at its decode-scheduler
    (reason "gateway ... is gone") and its decode state dropped here.

    A decode-scheduler's StreamTokenIDs call that ends (the worker died or restarted, or the stream
    broke) leaves its open rids without outputs: each is ended at its gateway with a retryable
    error, aborted at its scheduler (in case it still runs) and its decode state dropped here.
    """

    def __init__(
        self,
        detokenizer: IncrementalDetokenizer,
        worker: str,
        gateway_dead_after: float = DEFAULT_DEAD_AFTER_S,
        model_name: str = "",
    ) -> None:
        self.detokenizer = detokenizer
        self.worker = worker
        self.metrics = DetokenizerMetrics(model_name)
        self._routes: dict[str, Route] = {}
        self._gateways = ClientStreamPool(
            lambda ch: output_pb2_grpc.GatewayOutputStub(ch).StreamStrOutputs,
            dead_after=gateway_dead_after,
            on_dead=self._gateway_gone,
        )
        self._aborter = SchedulerAborter()
        self._stream_ids = itertools.count(1)

    async def StreamTokenIDs(
        self,
        request_iterator: AsyncIterator[output_pb2.BatchTokenIDOutput],
        context: grpc.aio.ServicerContext,
    ) -> output_pb2.StreamAck:
        self.metrics.scheduler_streams.inc()
        stream = next(self._stream_ids)
        try:
            async for batch in request_iterator:
                self.handle_batch(batch, stream)
        except ValueError as e:
            logger.error("bad BatchTokenIDOutput from %s: %s", context.peer(), e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            self.metrics.scheduler_streams.dec()
            self._stream_ended(stream)
        return output_pb2.StreamAck()

    async def GetMetrics(
        self, request: common_pb2.MetricsRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.MetricsResponse:
        return common_pb2.MetricsResponse(role="detokenizer", worker=self.worker, text=self.metrics.render())

    def handle_batch(self, batch: output_pb2.BatchTokenIDOutput, stream: int = 0) -> None:
        """Detokenize one step of one scheduler (arrived on call ``stream``) and queue the text to
        each gateway concerned, one ``BatchStrOutput`` per gateway (column rows stay column rows
        unless a stop string ends them).

        Raises:
            ValueError: the batch breaks the contract (a rid twice, ids out of the vocabulary,
                columns of different lengths); no state changed, and the stream call ends with
                INVALID_ARGUMENT.
        """
        with self.metrics.batch_seconds.time():
            columns = column_rows(batch)
            steps = [to_token_step(out) for out in batch.outputs]
            steps += [TokenStep(rid, ids) for rid, ids, _ in columns]
            deltas = self.detokenizer.step(steps)
            per_gateway: dict[str, StrBatchBuilder] = {}
            num_extras = len(batch.outputs)
            tokens = 0
            for i, (step, delta) in enumerate(zip(steps, deltas, strict=True)):
                if delta is None:
                    continue
                tokens += len(step.token_ids)
                out = batch.outputs[i] if i < num_extras else None
                if out is not None and is_first_output(out):
                    self._routes[out.rid] = to_route(out, stream)
                route = self._routes[delta.rid]
                builder = per_gateway.get(route.gateway_address)
                if builder is None:
                    builder = per_gateway[route.gateway_address] = StrBatchBuilder()
                if out is None:
                    rid, ids, completion = columns[i - num_extras]
                    if not delta.finished:
                        builder.add_column(rid, delta.text, ids, completion)
                        continue
                    out = output_pb2.TokenIDOutput(rid=rid, token_ids=ids, completion_tokens=completion)
                builder.extras.append(to_str_output(out, delta, route.index))
                if delta.finished:
                    del self._routes[out.rid]
                    tracing.record_span("detokenize", route.traceparent, route.started, time.time(), out.rid)
                if delta.matched_stop is not None:
                    self._stop_generation(out, route)
            self.metrics.tokens.inc(tokens)
            for address, builder in per_gateway.items():
                self._gateways.send(address, builder.build())
            self.metrics.active_streams.set(self.detokenizer.num_active)

    def _stop_generation(self, out: output_pb2.TokenIDOutput, route: Route) -> None:
        self.metrics.stop_string_matches.inc()
        if out.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            return  # the scheduler has already finished it
        if route.scheduler_address:
            self._aborter.abort(route.scheduler_address, out.rid, "stop", stopped=True)
        else:
            logger.warning(
                "rid %s hit a stop string but carries no scheduler_address to abort",
                out.rid,
                extra={"rid": out.rid},
            )

    def _stream_ended(self, stream: int) -> None:
        """Fail (retryable) every rid still open on scheduler stream ``stream``; drop its state."""
        rids = [rid for rid, route in self._routes.items() if route.stream == stream]
        if not rids:
            return
        logger.warning("a scheduler's output stream ended with %d requests open: failing them", len(rids))
        per_gateway: dict[str, list[output_pb2.StrOutput]] = {}
        for rid in rids:
            route = self._routes.pop(rid)
            per_gateway.setdefault(route.gateway_address, []).append(lost_output(rid, route))
            if route.scheduler_address:
                self._aborter.abort(route.scheduler_address, rid, "its output stream ended")
        self.detokenizer.discard(rids)
        for address, outputs in per_gateway.items():
            self._gateways.send(address, output_pb2.BatchStrOutput(outputs=outputs))
        self.metrics.active_streams.set(self.detokenizer.num_active)

    def _gateway_gone(self, address: str, dropped: list[output_pb2.BatchStrOutput]) -> None:
        """Abort every rid of the gateway at ``address`` at its scheduler and drop its decode state."""
        rids = [rid for rid, route in self._routes.items() if route.gateway_address == address]
        logger.warning(
            "gateway %s is gone: aborting its %d requests (%d output batches undelivered)",
            address,
            len(rids),
            len(dropped),
        )
        reason = f"gateway {address} is gone"
        for rid in rids:
            route = self._routes.pop(rid)
            if route.scheduler_address:
                self._aborter.abort(route.scheduler_address, rid, reason)
        self.detokenizer.discard(rids)
        self.metrics.active_streams.set(self.detokenizer.num_active)

    async def close(self) -> None:
        """Flush queued outputs and Abort calls, and close their channels."""
        await self._aborter.close()
        await self._gateways.close()
