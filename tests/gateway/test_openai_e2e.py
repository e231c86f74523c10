"""The OpenAI API end to end through all five services (``stack``: 1 prefill + 1 decode, real model).

Expected values come from the HF tokenizer / transformers reference or from a second request, never
from constants. Every test leaves the schedulers idle with their KV pools conserved (``stack``).
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import openai

from pdserve.services.gateway.main import Gateway, parse_args
from pdserve.v1 import api_pb2, api_pb2_grpc, common_pb2
from tests.reference import chat_ids, hf_greedy, hf_tokenizer

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Name one fruit."}]


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0)


async def wait_schedulers_idle(stack, within: float) -> float:
    """Seconds until every scheduler reports no running request and no used KV page (asserts ``within``)."""
    start = time.monotonic()
    while True:
        running = await asyncio.to_thread(stack.scheduler_values, "pdserve:num_running_reqs")
        used = await asyncio.to_thread(stack.scheduler_values, "pdserve:kv_pages_used")
        assert running and used, "no scheduler metrics"
        if not any(running.values()) and not any(used.values()):
            return time.monotonic() - start
        assert time.monotonic() - start < within, f"still busy after {within} s: {running} {used}"
        await asyncio.sleep(0.05)


def test_sync_chat_matches_reference_and_counts_usage(stack) -> None:
    resp = client(stack).chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8)
    prompt = chat_ids(MESSAGES)
    expected = hf_greedy(prompt, 8)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == hf_tokenizer().decode(expected, skip_special_tokens=True)
    assert choice.finish_reason == ("stop" if expected[-1] == hf_tokenizer().eos_token_id else "length")
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(prompt), len(expected))
    assert resp.usage.total_tokens == len(prompt) + len(expected)
    assert 0 <= resp.usage.prompt_tokens_details.cached_tokens <= len(prompt)


async def test_async_chat_echoes_request_id(stack) -> None:
    aclient = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0)
    raw = await aclient.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=4,
        extra_headers={"X-Request-Id": "e2e-rid-1"},
    )
    assert raw.headers["x-request-id"] == "e2e-rid-1"
    resp = raw.parse()
    assert resp.id == "chatcmpl-e2e-rid-1"
    assert resp.usage.completion_tokens == len(hf_greedy(chat_ids(MESSAGES), 4))


def test_streaming_chat_chunks_and_usage(stack) -> None:
    c = client(stack)
    full = c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=10)
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            temperature=0,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [ch for ch in chunks if ch.choices]
    assert [ch.choices[0].finish_reason for ch in with_choices][:-1] == [None] * (len(with_choices) - 1)
    assert with_choices[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in with_choices) == full.choices[0].message.content
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == len(chat_ids(MESSAGES))
    # The wire format ends with the [DONE] sentinel.
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_n3_gives_three_indexed_choices(stack) -> None:
    c = client(stack)
    resp = c.completions.create(
        model=MODEL, prompt="Once upon a time", n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=0
    )
    assert [ch.index for ch in resp.choices] == [0, 1, 2]
    assert resp.usage.completion_tokens == sum(len(ch.logprobs.tokens) for ch in resp.choices)
    assert resp.usage.prompt_tokens == len(hf_tokenizer()("Once upon a time")["input_ids"])
    stream = c.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=4, stream=True, seed=3)
    roles, finished, text = set(), set(), {0: "", 1: "", 2: ""}
    for chunk in stream:
        for ch in chunk.choices:
            if ch.delta.role:
                roles.add(ch.index)
            text[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert roles == finished == {0, 1, 2}
    assert all(text.values())


def test_batch_prompts_number_choices_prompt_major(stack) -> None:
    prompts = ["The capital of France is", "1, 2, 3,"]
    resp = client(stack).completions.create(model=MODEL, prompt=prompts, n=2, temperature=0, max_tokens=5)
    assert [ch.index for ch in resp.choices] == [0, 1, 2, 3]
    tok = hf_tokenizer()
    for j, prompt in enumerate(prompts):
        expected = tok.decode(hf_greedy(tok(prompt)["input_ids"], 5), skip_special_tokens=True)
        assert resp.choices[2 * j].text == resp.choices[2 * j + 1].text == expected
    assert resp.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) for p in prompts)


def test_seeded_sampling_repeats(stack) -> None:
    c = client(stack)
    kwargs = {
        "model": MODEL,
        "prompt": "My favourite animal is",
        "temperature": 1.0,
        "seed": 1234,
        "max_tokens": 8,
    }
    first, second = c.completions.create(**kwargs), c.completions.create(**kwargs)
    assert first.choices[0].text == second.choices[0].text


def test_logit_bias_steers_greedy_output_as_in_the_reference(stack) -> None:
    prompt = chat_ids(MESSAGES)
    plain = hf_greedy(prompt, 6)
    bias = {plain[0]: -100.0, plain[2]: 4.0}  # ban the first greedy token, favour the third
    expected = hf_greedy(prompt, 6, logit_bias=bias)
    assert expected[0] != plain[0]
    resp = client(stack).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=6,
        logit_bias={str(token): value for token, value in bias.items()},
    )
    assert resp.choices[0].message.content == hf_tokenizer().decode(expected, skip_special_tokens=True)
    assert resp.usage.completion_tokens == len(expected)


def test_logprobs_shapes(stack) -> None:
    c = client(stack)
    resp = c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert abs(entry.logprob - tops[0]) < 1e-4  # greedy picks the most likely token
        assert entry.bytes == list(entry.token.encode())
    assert "".join(e.token for e in content).startswith(resp.choices[0].message.content)
    comp = c.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=4, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == comp.usage.completion_tokens
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_native_generate_takes_a_batch_of_prompts(stack) -> None:
    texts = ["The sky is", "1, 2, 3,"]
    ids = [hf_tokenizer()(t)["input_ids"] for t in texts]
    expected = [hf_greedy(p, 5) for p in ids]
    params = {"temperature": 0, "max_new_tokens": 5}
    by_text = httpx.post(
        f"{stack.base_url}/generate", json={"text": texts, "sampling_params": params}, timeout=120
    )
    by_ids = httpx.post(
        f"{stack.base_url}/generate", json={"input_ids": ids, "sampling_params": params}, timeout=120
    )
    for response in (by_text, by_ids):
        outs = response.json()
        assert [o["output_ids"] for o in outs] == expected and [o["index"] for o in outs] == [0, 1]
        assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(p) for p in ids]
    one = httpx.post(
        f"{stack.base_url}/generate", json={"text": texts[:1], "sampling_params": params}, timeout=120
    )
    assert [o["output_ids"] for o in one.json()] == expected[:1]  # a batch of one is still a list
    body = {"text": texts, "sampling_params": {**params, "n": 2}, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/generate", json=body, timeout=120) as r:
        chunks = [
            json.loads(line.removeprefix("data: "))
            for line in r.iter_lines()
            if line and "[DONE]" not in line
        ]
    last = {c["index"]: c["output_ids"] for c in chunks}
    assert last == {0: expected[0], 1: expected[0], 2: expected[1], 3: expected[1]}  # prompt-major


def test_native_generate_no_stop_trim_keeps_the_stop_string(stack) -> None:
    params = {"temperature": 0, "max_new_tokens": 12}
    plain = httpx.post(
        f"{stack.base_url}/generate", json={"text": "The sky is", "sampling_params": params}, timeout=120
    )
    text = plain.json()["text"]
    stop = text.split()[2]  # a word the greedy continuation reaches
    kept = {}
    for name in ("no_stop_trim", "include_stop_str_in_output"):
        body = {"text": "The sky is", "sampling_params": {**params, "stop": stop, name: True}}
        kept[name] = httpx.post(f"{stack.base_url}/generate", json=body, timeout=120).json()
    assert kept["no_stop_trim"]["text"] == kept["include_stop_str_in_output"]["text"]
    assert kept["no_stop_trim"]["text"] == text[: text.index(stop) + len(stop)]
    assert kept["no_stop_trim"]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_native_generate_stream_equals_non_stream(stack) -> None:
    body = {"text": "The sky is", "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    full = httpx.post(f"{stack.base_url}/generate", json={**body, "rid": "native-1"}, timeout=120)
    assert full.headers["x-request-id"] == "native-1"
    out = full.json()
    prompt = hf_tokenizer()("The sky is")["input_ids"]
    assert out["output_ids"] == hf_greedy(prompt, 6)
    meta = out["meta_info"]
    assert meta["id"] == "native-1" and meta["prompt_tokens"] == len(prompt)
    assert meta["completion_tokens"] == len(out["output_ids"])
    assert meta["finish_reason"]["type"] in ("stop", "length")
    with httpx.stream("POST", f"{stack.base_url}/generate", json={**body, "stream": True}, timeout=120) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["output_ids"] == out["output_ids"] and chunks[-1]["text"] == out["text"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


async def test_clients_walking_away_abort_everywhere(stack) -> None:
    """32 streaming clients leave after their first content chunk: the schedulers drop them within 2 s."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "stream": True, "ignore_eos": True}

    async def walk_away(http: httpx.AsyncClient, i: int) -> None:
        async with http.stream(
            "POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": f"gone-{i}"}
        ) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    return

    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as http:
        await asyncio.gather(*(walk_away(http, i) for i in range(32)))
    left = time.monotonic()
    await wait_schedulers_idle(stack, within=2.0)
    assert time.monotonic() - left < 2.0


async def test_grpc_generate_streams_choices_and_cancel_or_abort_ends_it(stack) -> None:
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        stub = api_pb2_grpc.PdServeStub(channel)
        request = api_pb2.GenerateRequest(
            model=MODEL,
            text="The capital of France is",
            sampling_params=common_pb2.SamplingParams(temperature=0, max_new_tokens=5, n=2),
        )
        pieces = [p async for p in stub.Generate(request, timeout=120)]
        tok = hf_tokenizer()
        expected = hf_greedy(tok("The capital of France is")["input_ids"], 5)
        for index in (0, 1):
            mine = [p for p in pieces if p.index == index]
            assert [i for p in mine for i in p.token_ids] == expected
            assert mine[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
            assert mine[-1].usage.completion_tokens == len(expected)
            assert all(p.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for p in mine[:-1])
        long = api_pb2.GenerateRequest(
            text="Count to a thousand:",
            sampling_params=common_pb2.SamplingParams(max_new_tokens=400, ignore_eos=True),
        )
        call = stub.Generate(long, timeout=120)
        async for piece in call:
            if piece.token_ids:
                break
        call.cancel()
        await wait_schedulers_idle(stack, within=2.0)
        # The public Abort ends a running request by rid: its stream finishes with ABORT.
        long.rid = "grpc-abort-1"
        call = stub.Generate(long, timeout=120)
        pieces = []
        async for piece in call:
            pieces.append(piece)
            if len(pieces) == 1:
                found = await stub.Abort(api_pb2.PublicAbortRequest(rid="grpc-abort-1"))
                assert found.found
        assert pieces[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        assert sum(len(p.token_ids) for p in pieces) < 400
    await wait_schedulers_idle(stack, within=2.0)


async def test_second_replica_limits_pending_and_times_out(stack) -> None:
    """A second gateway replica on the same workers: 429 past --max-pending-requests, 504 past its timeout."""
    roles = httpx.get(f"{stack.base_url}/health", timeout=10).json()["roles"]
    flags = [f"--{role}-addresses={','.join(addrs)}" for role, addrs in roles.items()]
    args = parse_args(
        [*flags, "--port", "0", "--grpc-port", "0", "--max-pending-requests", "2", "--log-level", "warning"]
    )
    replica = Gateway(args)
    await replica.start()
    url = f"http://127.0.0.1:{replica.http_port}"
    slow = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True, "stream": True}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            streams = [http.stream("POST", "/v1/chat/completions", json=slow) for _ in range(2)]
            responses = [await s.__aenter__() for s in streams]
            assert [r.status_code for r in responses] == [200, 200]
            third = await http.post("/v1/chat/completions", json={**slow, "stream": False})
            assert third.status_code == 429 and third.headers["retry-after"] == "1"
            assert third.json()["error"]["type"] == "rate_limit_error"
            for s in streams:
                await s.__aexit__(None, None, None)
        await wait_schedulers_idle(stack, within=2.0)
        replica.manager.config.request_timeout = 0.5
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            timed_out = await http.post("/v1/chat/completions", json={**slow, "stream": False})
        assert timed_out.status_code == 504, timed_out.text
        await wait_schedulers_idle(stack, within=2.0)
    finally:
        await replica.stop()


def test_metrics_expose_every_role_with_labels(stack) -> None:
    client(stack).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    m = stack.metrics()
    configured = httpx.get(f"{stack.base_url}/health", timeout=10).json()["roles"]
    # Scheduler roles as they name themselves: a decode worker without a prefill pool is "mixed".
    expected = {"prefill", "decode"} if configured.get("prefill") else {"mixed"}
    assert {role for role, _ in m["pdserve:num_running_reqs"]} == expected
    workers = {w for role in ("prefill", "decode") for w in configured.get(role, {})}
    assert {w for _, w in m["pdserve:num_running_reqs"]} == workers
    gateway_ttft = {
        k: v for k, v in m["pdserve:time_to_first_token_seconds_count"].items() if k[0] == "gateway"
    }
    assert gateway_ttft and all(v >= 1 for v in gateway_ttft.values())
    assert any(k[0] == "detokenizer" for name in m for k in m[name])
