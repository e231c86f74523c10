"""The Tokenizer gRPC service in-process on a free port (real grpc.aio), against transformers."""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio
from transformers import AutoConfig

from pdserve.model_source import resolve_model
from pdserve.rpc.server import wait_for_health
from pdserve.services.tokenizer.main import build_parser, start_server
from pdserve.tokenization import Tokenizer
from pdserve.v1 import tokenizer_pb2 as pb
from pdserve.v1 import tokenizer_pb2_grpc

MESSAGES = [("system", "Be brief."), ("user", "Hi! 你好"), ("assistant", "Hello."), ("user", "Name a color.")]


def chat(**kwargs) -> pb.TokenizeRequest:
    messages = [pb.ChatMessage(role=r, content=c) for r, c in MESSAGES]
    return pb.TokenizeRequest(chat=pb.ChatMessages(messages=messages, **kwargs))


def hf_chat(tokenizer: Tokenizer, **kwargs) -> tuple[str, list[int]]:
    messages = [{"role": r, "content": c} for r, c in MESSAGES]
    text = tokenizer.hf.apply_chat_template(messages, tokenize=False, **kwargs)
    out = tokenizer.hf.apply_chat_template(messages, tokenize=True, **kwargs)
    return text, list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest_asyncio.fixture(scope="module")
async def stub():
    server = await start_server(build_parser().parse_args(["--port", "0"]))
    assert await wait_for_health(server.address, timeout=10)
    async with grpc.aio.insecure_channel(server.address) as channel:
        yield tokenizer_pb2_grpc.TokenizerStub(channel)
    await server.stop(0)


async def test_tokenize_text_and_chat(stub, tokenizer: Tokenizer) -> None:
    text = "Hello world, 你好 😀"
    for add in (True, False):
        resp = await stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=add))
        assert list(resp.input_ids) == tokenizer.hf.encode(text, add_special_tokens=add)
    resp = await stub.Tokenize(chat(add_generation_prompt=True))
    assert (resp.prompt_text, list(resp.input_ids)) == hf_chat(tokenizer, add_generation_prompt=True)


async def test_tokenize_batch_keeps_order(stub, tokenizer: Tokenizer) -> None:
    requests = [
        pb.TokenizeRequest(text="one"),
        chat(),
        pb.TokenizeRequest(text="two 二", add_special_tokens=True),
    ]
    resp = await stub.TokenizeBatch(pb.TokenizeBatchRequest(requests=requests))
    got = [list(r.input_ids) for r in resp.responses]
    assert got == [tokenizer.hf.encode("one"), hf_chat(tokenizer)[1], tokenizer.hf.encode("two 二")]


async def test_detokenize_and_info(stub, tokenizer: Tokenizer) -> None:
    ids = [1, *tokenizer.hf.encode("a 世界"), 2]
    for skip in (True, False):
        resp = await stub.Detokenize(pb.DetokenizeRequest(input_ids=ids, skip_special_tokens=skip))
        assert resp.text == tokenizer.hf.decode(ids, skip_special_tokens=skip)
    info = await stub.GetInfo(pb.TokenizerInfoRequest())
    assert (info.model_name, info.vocab_size, list(info.eos_token_ids), info.context_length) == (
        tokenizer.info.model_name,
        len(tokenizer.hf),
        [tokenizer.hf.eos_token_id],
        AutoConfig.from_pretrained(resolve_model()).max_position_embeddings,
    )


async def test_token_pieces_keep_each_tokens_bytes(stub, tokenizer: Tokenizer) -> None:
    ids = tokenizer.hf.encode("naïve 😀 世界", add_special_tokens=False)
    resp = await stub.GetTokenPieces(pb.TokenPiecesRequest(ids=[*ids, 2]))
    assert b"".join(p.bytes for p in resp.pieces[:-1]) == "naïve 😀 世界".encode()
    assert resp.pieces[-1].text == "<|im_end|>"
    assert [p.text for p in resp.pieces] == [p.text for p in tokenizer.token_pieces([*ids, 2])]


@pytest.mark.parametrize(
    ("call", "request_", "message"),
    [
        ("Tokenize", pb.TokenizeRequest(), "needs text or chat"),
        ("Tokenize", pb.TokenizeRequest(text="a" * 2_000_000), "2000000 characters is longer than"),
        ("Tokenize", pb.TokenizeRequest(chat=pb.ChatMessages()), "at least one message"),
        ("Tokenize", chat(tools_json="[{"), "tools_json is not valid JSON"),
        ("Tokenize", chat(tools_json='{"a": 1}'), "must be a JSON list"),
        ("Tokenize", chat(tools_json="[1]"), "list of JSON objects"),
        ("Tokenize", chat(chat_template_kwargs_json="[]"), "must be a JSON dict"),
        ("Tokenize", chat(chat_template_kwargs_json='{"tokenize": true}'), "may not set tokenize"),
        ("Tokenize", chat(add_generation_prompt=True, continue_final_message=True), "exclude each other"),
        ("TokenizeBatch", pb.TokenizeBatchRequest(requests=[chat(), pb.TokenizeRequest()]), "requests[1]"),
        ("Detokenize", pb.DetokenizeRequest(input_ids=[5, 49152]), "out of range"),
        ("Detokenize", pb.DetokenizeRequest(input_ids=[-3]), "out of range"),
        ("GetTokenPieces", pb.TokenPiecesRequest(ids=[49152]), "out of range"),
        ("Tokenize", chat(continue_final_message=True), "assistant message last"),
    ],
)
async def test_bad_input_is_invalid_argument(stub, call: str, request_, message: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await getattr(stub, call)(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
