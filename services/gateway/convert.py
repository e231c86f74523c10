"""Conversions between the gateway's ``io_struct`` objects and the ``pdserve.v1`` protobuf messages."""

from __future__ import annotations

import dataclasses
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict

from pdserve.services.gateway.io_struct import (
    ChatPrompt,
    ChoiceDelta,
    ModelInfo,
    Prompt,
    SamplingParams,
    TokenizedPrompt,
    TokenLogprob,
    TopLogprob,
    WorkerLoad,
)
from pdserve.v1 import api_pb2, common_pb2, output_pb2, scheduler_pb2, tokenizer_pb2

_FINISH_FROM_PB = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}
_FINISH_TO_PB = {v: k for k, v in _FINISH_FROM_PB.items()}


def sampling_params_to_pb(sp: SamplingParams) -> common_pb2.SamplingParams:
    fields = {k: v for k, v in dataclasses.asdict(sp).items() if v is not None}
    return common_pb2.SamplingParams(**fields)


# 64-bit integer fields, which protobuf's JSON mapping writes as strings
_INT64_FIELDS = frozenset(
    f.name
    for f in common_pb2.SamplingParams.DESCRIPTOR.fields
    if f.cpp_type in (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64)
)


def sampling_params_dict(pb: common_pb2.SamplingParams) -> dict[str, Any]:
    """The fields set in ``pb`` as the JSON body's dict, keyed by proto field names (unset optionals
    left out); 64-bit integers stay integers (the request models' types are strict)."""
    fields = MessageToDict(pb, preserving_proto_field_name=True)
    for name in fields.keys() & _INT64_FIELDS:
        fields[name] = getattr(pb, name)
    return fields


def tokenize_request(prompt: Prompt, add_special_tokens: bool) -> tokenizer_pb2.TokenizeRequest:
    """``Tokenizer.Tokenize`` input for a text or chat prompt (token-id prompts need no call)."""
    if isinstance(prompt, ChatPrompt):
        chat = tokenizer_pb2.ChatMessages(
            messages=[tokenizer_pb2.ChatMessage(**m) for m in prompt.messages],
            add_generation_prompt=prompt.add_generation_prompt,
            continue_final_message=prompt.continue_final_message,
            tools_json=prompt.tools_json,
            chat_template_kwargs_json=prompt.chat_template_kwargs_json,
        )
        return tokenizer_pb2.TokenizeRequest(chat=chat, add_special_tokens=add_special_tokens)
    return tokenizer_pb2.TokenizeRequest(text=prompt, add_special_tokens=add_special_tokens)


def tokenized_prompt_from_pb(pb: tokenizer_pb2.TokenizeResponse) -> TokenizedPrompt:
    return TokenizedPrompt(input_ids=list(pb.input_ids), prompt_text=pb.prompt_text)


def model_info_from_pb(pb: tokenizer_pb2.TokenizerInfoResponse) -> ModelInfo:
    return ModelInfo(
        model_name=pb.model_name,
        vocab_size=pb.vocab_size,
        eos_token_ids=tuple(pb.eos_token_ids),
        context_length=pb.context_length,
        think_tokens=pb.think_tokens,
    )


def tokenized_req_to_pb(
    rid: str,
    input_ids: list[int],
    sampling_params: SamplingParams,
    *,
    prefill_address: str,
    fallback_prefill_addresses: list[str],
    output_address: str,
    gateway_address: str,
    deadline_unix_s: float,
    arrival_unix_s: float,
) -> scheduler_pb2.TokenizedGenerateReqInput:
    return scheduler_pb2.TokenizedGenerateReqInput(
        rid=rid,
        input_ids=input_ids,
        sampling_params=sampling_params_to_pb(sampling_params),
        prefill_address=prefill_address,
        fallback_prefill_addresses=fallback_prefill_addresses,
        output_address=output_address,
        gateway_address=gateway_address,
        deadline_unix_s=deadline_unix_s,
        arrival_unix_s=arrival_unix_s,
    )


def worker_load_from_pb(info: common_pb2.LoadInfo) -> WorkerLoad:
    """A scheduler's ``LoadInfo`` as the router and admission control use it."""
    bounded = info.max_queued_requests > 0
    return WorkerLoad(
        load=info.num_running_reqs + info.num_queue_reqs,
        capacity=info.request_capacity + info.max_queued_requests if bounded else 0,
        incarnation=info.incarnation,
    )


def choice_delta_from_pb(out: output_pb2.StrOutput, index: int) -> ChoiceDelta:
    """A ``ChoiceDelta`` for choice ``index`` from one detokenizer ``StrOutput``."""
    if out.matched_stop:
        matched: str | int | None = out.matched_stop
    elif out.finish_reason == common_pb2.FINISH_REASON_STOP and out.matched_stop_token:
        matched = out.matched_stop_token
    else:
        matched = None
    return ChoiceDelta(
        index=index,
        text=out.text_delta,
        token_ids=list(out.token_ids),
        logprobs=[
            TokenLogprob(lp.token_id, lp.logprob, [TopLogprob(t.token_id, t.logprob) for t in lp.top])
            for lp in out.logprobs
        ],
        finish_reason=_FINISH_FROM_PB.get(out.finish_reason),
        matched_stop=matched,
        error=out.error,
        retryable=out.retryable,
        prompt_tokens=out.prompt_tokens,
        cached_tokens=out.cached_tokens,
        completion_tokens=out.completion_tokens,
    )


def generate_response_to_pb(rid: str, delta: ChoiceDelta) -> api_pb2.GenerateResponse:
    """The public API's streamed piece for ``delta``; usage is set on a choice's last piece."""
    resp = api_pb2.GenerateResponse(
        rid=rid,
        index=delta.index,
        text=delta.text,
        token_ids=delta.token_ids,
        logprobs=[
            common_pb2.TokenLogprob(
                token_id=lp.token_id,
                logprob=lp.logprob,
                top=[common_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in lp.top],
            )
            for lp in delta.logprobs
        ],
    )
    if delta.finish_reason is not None:
        resp.finish_reason = _FINISH_TO_PB[delta.finish_reason]
        if isinstance(delta.matched_stop, int):
            resp.matched_stop_token = delta.matched_stop
        elif delta.matched_stop is not None:
            resp.matched_stop = delta.matched_stop
        resp.usage.CopyFrom(
            api_pb2.Usage(
                prompt_tokens=delta.prompt_tokens,
                completion_tokens=delta.completion_tokens,
                cached_tokens=delta.cached_tokens,
            )
        )
    return resp
