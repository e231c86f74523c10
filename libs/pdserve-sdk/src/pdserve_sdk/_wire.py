"""The public API's schema at run time: message classes and method callables from a private pool.

The build (``setup.py``) compiles the repository's ``proto/pdserve/v1/api.proto`` (with its imports)
and grpc's ``health.proto`` into ``pdserve_api.binpb``, a ``FileDescriptorSet``. It is loaded here
into a private ``DescriptorPool`` rather than protoc's ``--python_out`` modules, which register in
the process-wide default pool: the server's generated ``pdserve.v1`` modules define the same
``pdserve.v1.*`` symbols, so a second registration under another file name would fail with
"duplicate symbol" in any process that imports both (a test suite, a benchmark, a gateway plugin).
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import grpc
import grpc.aio
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PDSERVE_SERVICE = "pdserve.v1.PdServe"
HEALTH_SERVICE = "grpc.health.v1.Health"


def _load_pool() -> descriptor_pool.DescriptorPool:
    data = (resources.files(__package__) / "pdserve_api.binpb").read_bytes()
    pool = descriptor_pool.DescriptorPool()
    for file in descriptor_pb2.FileDescriptorSet.FromString(data).file:  # dependencies come first
        pool.Add(file)
    return pool


_POOL = _load_pool()


def message_class(full_name: str) -> Any:
    """The generated message class for ``full_name`` (e.g. ``"pdserve.v1.GenerateRequest"``)."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(full_name))


def enum_names(full_name: str) -> dict[int, str]:
    """``{number: name}`` of the enum ``full_name``."""
    return {v.number: v.name for v in _POOL.FindEnumTypeByName(full_name).values}


GenerateRequest = message_class("pdserve.v1.GenerateRequest")
SamplingParams = message_class("pdserve.v1.SamplingParams")
TokenIds = message_class("pdserve.v1.TokenIds")
ChatMessages = message_class("pdserve.v1.ChatMessages")
ChatMessage = message_class("pdserve.v1.ChatMessage")
EmbedRequest = message_class("pdserve.v1.EmbedRequest")
PublicAbortRequest = message_class("pdserve.v1.PublicAbortRequest")
ListModelsRequest = message_class("pdserve.v1.ListModelsRequest")
LoadLoraAdapterRequest = message_class("pdserve.v1.PublicLoadLoraAdapterRequest")
UnloadLoraAdapterRequest = message_class("pdserve.v1.PublicUnloadLoraAdapterRequest")
HealthCheckRequest = message_class("grpc.health.v1.HealthCheckRequest")

FINISH_REASONS = enum_names("pdserve.v1.FinishReason")
SERVING_STATUSES = enum_names("grpc.health.v1.HealthCheckResponse.ServingStatus")


def _method(channel: grpc.Channel | grpc.aio.Channel, service: str, name: str) -> Any:
    """A multicallable for ``/{service}/{name}`` on ``channel`` (sync or asyncio)."""
    method = _POOL.FindServiceByName(service).methods_by_name[name]
    request = message_factory.GetMessageClass(method.input_type)
    response = message_factory.GetMessageClass(method.output_type)
    factory = channel.unary_stream if method.server_streaming else channel.unary_unary
    return factory(
        f"/{service}/{name}",
        request_serializer=request.SerializeToString,
        response_deserializer=response.FromString,
    )


class Stubs:
    """The callables of ``pdserve.v1.PdServe`` and ``grpc.health.v1.Health/Check`` on one channel."""

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel) -> None:
        self.generate = _method(channel, PDSERVE_SERVICE, "Generate")
        self.embed = _method(channel, PDSERVE_SERVICE, "Embed")
        self.abort = _method(channel, PDSERVE_SERVICE, "Abort")
        self.list_models = _method(channel, PDSERVE_SERVICE, "ListModels")
        self.load_lora_adapter = _method(channel, PDSERVE_SERVICE, "LoadLoraAdapter")
        self.unload_lora_adapter = _method(channel, PDSERVE_SERVICE, "UnloadLoraAdapter")
        self.health_check = _method(channel, HEALTH_SERVICE, "Check")
