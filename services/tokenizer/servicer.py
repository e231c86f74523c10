"""TokenizerServicer: the pdserve.v1 Tokenizer service (stateless; CPU work runs off the event loop)."""

from __future__ import annotations

import asyncio

import grpc

from pdserve.services.tokenizer.convert import info_to_pb, tokenize
from pdserve.tokenization import Tokenizer
from pdserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name
add_to_server = tokenizer_pb2_grpc.add_TokenizerServicer_to_server


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """Tokenize / TokenizeBatch / Detokenize / GetTokenPieces / GetInfo over one loaded ``Tokenizer``.

    Bad input (no input, bad JSON, a chat the template rejects, ids out of range) ends the call
    with INVALID_ARGUMENT and the reason as details; nothing is kept between calls.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._info = info_to_pb(tokenizer.info)

    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        try:
            return await asyncio.to_thread(tokenize, self.tokenizer, request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def TokenizeBatch(
        self, request: tokenizer_pb2.TokenizeBatchRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeBatchResponse:
        try:
            responses = await asyncio.to_thread(self._tokenize_batch, request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return tokenizer_pb2.TokenizeBatchResponse(responses=responses)

    async def Detokenize(
        self, request: tokenizer_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.DetokenizeResponse:
        try:
            text = await asyncio.to_thread(
                self.tokenizer.decode, list(request.input_ids), request.skip_special_tokens
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return tokenizer_pb2.DetokenizeResponse(text=text)

    async def GetTokenPieces(
        self, request: tokenizer_pb2.TokenPiecesRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenPiecesResponse:
        try:
            pieces = self.tokenizer.token_pieces(list(request.ids))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return tokenizer_pb2.TokenPiecesResponse(
            pieces=[tokenizer_pb2.TokenPiece(text=p.text, bytes=p.data) for p in pieces]
        )

    async def GetInfo(
        self, request: tokenizer_pb2.TokenizerInfoRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizerInfoResponse:
        return self._info

    def _tokenize_batch(
        self, request: tokenizer_pb2.TokenizeBatchRequest
    ) -> list[tokenizer_pb2.TokenizeResponse]:
        """Plain texts go through one batched encode per ``add_special_tokens`` value; chats one by one."""
        responses: list[tokenizer_pb2.TokenizeResponse | None] = [None] * len(request.requests)
        texts: dict[bool, list[int]] = {}
        for i, req in enumerate(request.requests):
            if req.WhichOneof("input") == "text":
                texts.setdefault(req.add_special_tokens, []).append(i)
                continue
            try:
                responses[i] = tokenize(self.tokenizer, req)
            except ValueError as e:
                raise ValueError(f"requests[{i}]: {e}") from e
        for add_special, indices in texts.items():
            ids = self.tokenizer.encode_batch([request.requests[i].text for i in indices], add_special)
            for i, input_ids in zip(indices, ids, strict=True):
                responses[i] = tokenizer_pb2.TokenizeResponse(input_ids=input_ids)
        return responses
