"""The gateway's gRPC edges, and the only gateway modules that touch ``pdserve.v1``.

Servicers: ``public_servicer`` (the public ``PdServe`` API the SDK calls) and ``output_servicer``
(``GatewayOutput``, where the detokenizers stream outputs). Clients: ``backend_clients`` (tokenizer,
decode, prefill, detokenizer). ``convert``: every protobuf message built or read, to and from the
transport-free ``io_struct`` objects. ``interceptors``: refusing malformed request messages.
"""
