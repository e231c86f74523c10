"""``GatewayOutput``: where the detokenizers stream the outputs of this replica's requests.

Each detokenizer holds one long-lived client stream to every gateway replica that owns a request it
detokenizes; an output is delivered to the ``RequestHandle`` that owns its rid (``requests.state``)
and dropped when this replica no longer holds the rid (aborted, timed out).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pdserve.services.gateway.io_struct import ChoiceDelta
from pdserve.services.gateway.requests.state import RequestRegistry
from pdserve.services.gateway.transport import convert
from pdserve.v1 import output_pb2, output_pb2_grpc

SERVICE_NAME = output_pb2.DESCRIPTOR.services_by_name["GatewayOutput"].full_name
add_to_server = output_pb2_grpc.add_GatewayOutputServicer_to_server


class GatewayOutputServicer(output_pb2_grpc.GatewayOutputServicer):
    """``GatewayOutput.StreamStrOutputs``: one long-lived client stream per detokenizer."""

    def __init__(self, registry: RequestRegistry) -> None:
        self.registry = registry

    async def StreamStrOutputs(
        self, request_iterator: AsyncIterator[output_pb2.BatchStrOutput], context: grpc.aio.ServicerContext
    ) -> output_pb2.StreamAck:
        async for batch in request_iterator:
            for out in batch.outputs:
                state = self.registry.get(out.rid)
                if state is not None:
                    state.owner.push(state, convert.choice_delta_from_pb(out, state.index))
            for rid, text, ids, completion in convert.str_columns(batch):
                state = self.registry.get(rid)
                if state is not None:
                    state.owner.push(state, ChoiceDelta(state.index, text, ids, completion_tokens=completion))
        return output_pb2.StreamAck()
