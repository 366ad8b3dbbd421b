"""The OpenAI-compatible server end to end: the official ``openai`` client against a live server.

Runs against the ``server`` fixture (conftest.py), so the same checks apply to the fake engine and, later,
to the real one: streamed text == non-streamed text, usage counts, include_usage, 4xx with the field named,
413, 16 concurrent requests, a disconnect aborts its request and frees its KV blocks, /metrics series.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from .conftest import MAX_REQUEST_BODY_BYTES, LiveServer, client, concurrent_chat, metric_value, wait_until
from .fake_engine import FAIL_MARKER

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]
PROMPT = "The capital of France is"


def chat_prompt_len(server: LiveServer, messages: list[dict]) -> int:
    tok = server.engine.tokenizer
    return len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True),
                          add_special_tokens=False))


# ---------------------------------------------------------------------------------------------- basics


def test_health_and_models(server: LiveServer) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    models = client(server).models.list()
    assert [m.id for m in models.data] == [server.model]
    assert client(server).models.retrieve(server.model).id == server.model
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("no-such-model")


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_explicit_nulls_mean_the_defaults(server: LiveServer, endpoint: str) -> None:
    # OpenAI's API takes null for its optional fields; clients that serialise every field send them. The fields
    # this server refuses (protocol.UNSUPPORTED) pass with null or the value that asks for nothing.
    nulls = {"n": None, "stream": None, "presence_penalty": None, "frequency_penalty": None, "ignore_eos": None,
             "stop": None, "seed": None, "temperature": 0, "min_p": 0, "repetition_penalty": 1.0, "min_tokens": None,
             "guided_json": None, "response_format": {"type": "text", "json_schema": None}, "allowed_token_ids": None}
    if endpoint == "chat":
        path, body = "/chat/completions", {"messages": MESSAGES}
        nulls |= {"tools": [], "tool_choice": "none", "function_call": None}
    else:
        path, body = "/completions", {"prompt": PROMPT, "echo": None}
    with httpx.Client(base_url=server.api_url, timeout=60) as http:
        plain = http.post(path, json={"model": server.model, "max_tokens": 8, "temperature": 0, **body})
        nulled = http.post(path, json={"model": server.model, "max_tokens": 8, **nulls, **body})
    assert plain.status_code == nulled.status_code == 200, nulled.text
    assert nulled.json()["choices"] == plain.json()["choices"]


def test_chat_completion(server: LiveServer) -> None:
    resp = client(server).chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=24,
                                                  temperature=0)
    assert resp.id.startswith("chatcmpl-")
    assert resp.object == "chat.completion"
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens == chat_prompt_len(server, MESSAGES)
    assert 1 <= resp.usage.completion_tokens <= 24
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_content_parts(server: LiveServer) -> None:
    content = [{"type": "text", "text": "Name three"}, {"type": "text", "text": "colours."}]
    parts = [{"role": "user", "content": content}]
    resp = client(server).chat.completions.create(model=server.model, messages=parts, max_tokens=8,
                                                  temperature=0)
    joined = [{"role": "user", "content": "Name three\ncolours."}]
    assert resp.usage.prompt_tokens == chat_prompt_len(server, joined)


def test_completion(server: LiveServer) -> None:
    resp = client(server).completions.create(model=server.model, prompt=PROMPT, max_tokens=16, temperature=0)
    assert resp.id.startswith("cmpl-")
    assert resp.object == "text_completion"
    assert resp.choices[0].text
    assert resp.usage.prompt_tokens == len(server.engine.tokenizer.encode(PROMPT, add_special_tokens=True))
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion_token_ids_and_single_string_list(server: LiveServer) -> None:
    ids = server.engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    c = client(server)
    by_ids = c.completions.create(model=server.model, prompt=ids, max_tokens=12, temperature=0)
    by_list = c.completions.create(model=server.model, prompt=[PROMPT], max_tokens=12, temperature=0)
    by_text = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_list.choices[0].text == by_text.choices[0].text


def test_max_tokens_gives_length(server: LiveServer) -> None:
    resp = client(server).completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5


def test_max_completion_tokens(server: LiveServer) -> None:
    resp = client(server).chat.completions.create(model=server.model, messages=MESSAGES, temperature=0,
                                                  max_completion_tokens=4, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 4


def test_default_max_tokens_fills_context(server: LiveServer) -> None:
    """Without max_tokens, generation may run to the end of the context: max_model_len - prompt tokens."""
    max_model_len = server.engine.max_model_len
    token_id = server.engine.tokenizer.encode(" hello", add_special_tokens=False)[0]
    prompt = [token_id] * (max_model_len - 3)
    resp = client(server).completions.create(model=server.model, prompt=prompt, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == max_model_len - 3
    assert resp.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client(server).completions.create(model=server.model, prompt=[token_id] * max_model_len)


def test_stop_string_truncates(server: LiveServer) -> None:
    c = client(server)
    full = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=32, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) >= 16
    stop = full[8:12]
    cut = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=32, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[:full.index(stop)]
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=32, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices)
    assert streamed == cut.choices[0].text


def test_speculative_field_accepted(server: LiveServer) -> None:
    """Speculation is off by default; n-gram lookup is always loaded, so a request may turn it on."""
    c = client(server)
    for spec, speculates in (({"method": "ngram", "num_spec_tokens": 3}, True), ({"method": "ngram"}, True),
                             ("off", False), ({"method": "none"}, False), ({"num_spec_tokens": 2}, False),
                             (None, False)):
        resp = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"speculative": spec})
        assert resp.choices[0].text is not None
        usage = resp.usage.model_dump()
        assert (usage.get("speculative") is not None) == speculates, (spec, usage)
        if isinstance(spec, dict) and "num_spec_tokens" in spec and speculates:
            assert usage["speculative"]["num_spec_tokens"] == spec["num_spec_tokens"], usage


# -------------------------------------------------------------------------------------------- streaming


def test_chat_stream_equals_non_stream(server: LiveServer) -> None:
    c = client(server)
    kwargs = dict(model=server.model, messages=MESSAGES, max_tokens=40, temperature=0)
    full = c.chat.completions.create(**kwargs)
    chunks = list(c.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.id == chunks[0].id and ch.object == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert all(ch.usage is None for ch in chunks)


def test_completion_stream_equals_non_stream(server: LiveServer) -> None:
    c = client(server)
    kwargs = dict(model=server.model, prompt=PROMPT, max_tokens=40, temperature=0)
    full = c.completions.create(**kwargs)
    chunks = list(c.completions.create(stream=True, **kwargs))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_stream_include_usage(server: LiveServer, endpoint: str) -> None:
    c = client(server)
    if endpoint == "chat":
        kwargs = dict(model=server.model, messages=MESSAGES, max_tokens=20, temperature=0)
        full = c.chat.completions.create(**kwargs)
        chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                **kwargs))
    else:
        kwargs = dict(model=server.model, prompt=PROMPT, max_tokens=20, temperature=0)
        full = c.completions.create(**kwargs)
        chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.model_dump() == full.usage.model_dump()
    assert all(ch.usage is None for ch in chunks[:-1])


def test_stream_raw_sse_format(server: LiveServer) -> None:
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{server.api_url}/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][len("data: "):])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" not in json.loads(e[len("data: "):]) for e in events[:-1])  # as OpenAI, without include_usage
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{server.api_url}/chat/completions", json=body, timeout=30) as resp:
        events = [json.loads(e[len("data: "):]) for e in resp.read().decode().split("\n\n")
                  if e and e != "data: [DONE]"]
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] >= 1


# ------------------------------------------------------------------------------------------- bad input

BIG_PROMPT_WORDS = "hello "  # >= 1 token per word for any tokenizer worth the name


def _bad_cases(max_model_len: int) -> list[tuple[str, dict, int, str | None]]:
    msgs = [{"role": "user", "content": "hi"}]
    long_text = BIG_PROMPT_WORDS * (max_model_len + 16)
    chat = "/chat/completions"
    comp = "/completions"
    return [
        (chat, {"messages": msgs, "temperature": 2.5}, 400, "temperature"),
        (chat, {"messages": msgs, "temperature": -0.1}, 400, "temperature"),
        (chat, {"messages": msgs, "temperature": "hot"}, 400, "temperature"),
        (chat, {"messages": msgs, "top_p": 0}, 400, "top_p"),
        (chat, {"messages": msgs, "top_p": 1.5}, 400, "top_p"),
        (chat, {"messages": msgs, "top_k": -2}, 400, "top_k"),
        (chat, {"messages": msgs, "top_k": 1.5}, 400, "top_k"),
        (chat, {"messages": msgs, "max_tokens": 0}, 400, "max_tokens"),
        (chat, {"messages": msgs, "max_tokens": -3}, 400, "max_tokens"),
        (chat, {"messages": msgs, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        (chat, {"messages": msgs, "max_tokens": max_model_len}, 400, "max_tokens"),
        (chat, {"messages": msgs, "n": 2}, 400, "n"),
        (chat, {"messages": msgs, "logprobs": True}, 400, "logprobs"),
        (chat, {"messages": msgs, "top_logprobs": 3}, 400, "top_logprobs"),
        (chat, {"messages": msgs, "presence_penalty": 0.5}, 400, "presence_penalty"),
        (chat, {"messages": msgs, "frequency_penalty": -1}, 400, "frequency_penalty"),
        (chat, {"messages": msgs, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        (chat, {"messages": msgs, "stop": 7}, 400, "stop"),
        (chat, {"messages": msgs, "stop": ""}, 400, "stop"),
        (chat, {"messages": msgs, "stop": ["ok", ""]}, 400, "stop"),
        (chat, {"messages": msgs, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
        (chat, {"messages": msgs, "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
        (chat, {"messages": msgs, "stream": "yes"}, 400, "stream"),
        (chat, {"messages": msgs, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        (chat, {"messages": msgs, "speculative": 3}, 400, "speculative"),
        (chat, {"messages": msgs, "speculative": "sometimes"}, 400, "speculative"),
        (chat, {"messages": msgs, "speculative": {"method": "bogus"}}, 400, "speculative"),
        (chat, {"messages": msgs, "speculative": {"method": "eagle3"}}, 400, "speculative"),
        (chat, {"messages": msgs, "speculative": {"num_spec_tokens": 17}}, 400, "speculative"),
        (chat, {"messages": msgs, "speculative": {"foo": 1}}, 400, "speculative"),
        (chat, {"messages": []}, 400, "messages"),
        (chat, {"messages": [{"role": "user"}]}, 400, "messages"),
        (chat, {"messages": [{"role": "system", "content": []}, *msgs]}, 400, "messages"),
        (chat, {"messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        (chat, {"messages": msgs, "tool_choice": "auto"}, 400, "tool_choice"),
        (chat, {"messages": msgs, "response_format": {"type": "json_object"}}, 400, "response_format"),
        (chat, {"messages": msgs, "min_p": 0.05}, 400, "min_p"),
        (chat, {"messages": msgs, "repetition_penalty": 1.2}, 400, "repetition_penalty"),
        (comp, {"prompt": "x", "min_tokens": 4}, 400, "min_tokens"),
        (comp, {"prompt": "x", "guided_choice": ["a", "b"]}, 400, "guided_choice"),
        (comp, {"prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format"),
        (comp, {"prompt": "x", "structured_outputs": {"regex": "[a-z]+"}}, 400, "structured_outputs"),
        (comp, {"prompt": "x", "allowed_token_ids": [1, 2]}, 400, "allowed_token_ids"),
        (chat, {"messages": msgs, "response_format": {"type": "text", "json_schema": {"a": 1}}}, 400,
         "response_format"),
        (chat, {}, 400, "messages"),
        (chat, {"messages": "hi"}, 400, "messages"),
        (chat, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
        (chat, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         400, "messages"),
        (chat, {"messages": [{"role": "user", "content": long_text}]}, 400, "messages"),
        (chat, {"messages": msgs, "model": "no-such-model"}, 404, "model"),
        (comp, {}, 400, "prompt"),
        (comp, {"prompt": []}, 400, "prompt"),
        (comp, {"prompt": ["a", "b"]}, 400, "prompt"),
        (comp, {"prompt": [[1, 2]]}, 400, "prompt"),
        (comp, {"prompt": [10**9]}, 400, "prompt"),
        (comp, {"prompt": long_text}, 400, "prompt"),
        (comp, {"prompt": "hi", "max_tokens": max_model_len}, 400, "max_tokens"),
        (comp, {"prompt": "hi", "logprobs": 1}, 400, "logprobs"),
        (comp, {"prompt": "hi", "echo": True}, 400, "echo"),
        (comp, {"prompt": "hi", "n": 3}, 400, "n"),
        (comp, {"prompt": "hi", "speculative": {"num_spec_tokens": -1}}, 400, "speculative"),
        (comp, {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    ]


def test_bad_input_gets_4xx_naming_the_field(server: LiveServer) -> None:
    failures = []
    with httpx.Client(base_url=server.api_url, timeout=30) as http:
        for path, body, status, param in _bad_cases(server.engine.max_model_len):
            body = {"model": server.model, **body}
            resp = http.post(path, json=body)
            err = resp.json().get("error", {}) if resp.headers.get("content-type", "").startswith(
                "application/json") else {}
            ok = (resp.status_code == status and err.get("param") == param and param in err.get("message", "")
                  and isinstance(err.get("type"), str))
            if not ok:
                failures.append((path, str(body)[:120], resp.status_code, resp.text[:300]))
    assert not failures, "\n".join(map(str, failures))


def test_openai_client_raises_bad_request(server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(model=server.model, messages=MESSAGES, temperature=3)
    assert info.value.status_code == 400
    assert "temperature" in str(info.value)
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(model="nope", messages=MESSAGES)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_malformed_json_is_400(server: LiveServer, raw: bytes) -> None:
    resp = httpx.post(f"{server.api_url}/chat/completions", content=raw,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"]


def test_body_too_large_is_413(server: LiveServer) -> None:
    filler = "x" * (MAX_REQUEST_BODY_BYTES + 1024)
    resp = httpx.post(f"{server.api_url}/completions", json={"model": server.model, "prompt": filler},
                      timeout=30)
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_unknown_route_is_json_404(server: LiveServer) -> None:
    resp = httpx.get(f"{server.base_url}/v1/nothing-here")
    assert resp.status_code == 404
    assert "error" in resp.json()


def test_engine_exception_is_500_and_server_survives(fake_server: LiveServer) -> None:
    server = fake_server
    c = client(server)
    with pytest.raises(openai.InternalServerError) as info:
        c.completions.create(model=server.model, prompt=FAIL_MARKER, max_tokens=4)
    assert info.value.status_code == 500
    raw = httpx.post(f"{server.api_url}/completions", timeout=30,
                     json={"model": server.model, "prompt": FAIL_MARKER, "stream": True}).text
    assert '"error"' in raw and raw.rstrip().endswith("data: [DONE]")
    assert c.completions.create(model=server.model, prompt=PROMPT, max_tokens=4).choices[0].text


def test_top_k_beyond_the_vocabulary_is_off_and_spares_the_batch(server: LiveServer) -> None:
    """Any positive top_k is accepted (as in vLLM); one at or above the vocabulary keeps every token. Sampled
    requests with such a top_k share steps with a greedy one, which still equals its run alone."""
    alone = dict(messages=MESSAGES, max_tokens=24, temperature=0, seed=1)
    want = concurrent_chat(server, [alone])[0]
    sampled = [dict(messages=MESSAGES, max_tokens=24, temperature=1.0, seed=i, extra_body={"top_k": k})
               for i, k in enumerate([1 << 20, 1 << 40, 2**62])]  # SmolLM2's vocabulary: 49,152
    results = concurrent_chat(server, [alone, *sampled])
    assert results[0] == want
    assert all(text and finish in ("stop", "length") for text, finish in results[1:])
    assert wait_until(lambda: server.engine.kv_cache_usage() == 0.0)


def test_a_500_keeps_the_connection_open(fake_server: LiveServer) -> None:
    """After an internal error's 500 the same keep-alive connection serves the next request (the server once
    closed it, so a client's next request on a pooled connection failed)."""
    server = fake_server
    conn = http.client.HTTPConnection(urlsplit(server.base_url).netloc, timeout=30)
    conn.auto_open = 0  # a closed connection must fail the second request, not be silently reopened
    conn.connect()
    try:
        for prompt, status in ((FAIL_MARKER, 500), (PROMPT, 200)):
            conn.request("POST", "/v1/completions", headers={"content-type": "application/json"},
                         body=json.dumps({"model": server.model, "prompt": prompt, "max_tokens": 4}))
            resp = conn.getresponse()
            body = json.loads(resp.read())
            assert resp.status == status, body
        assert body["choices"][0]["text"]
    finally:
        conn.close()


# ---------------------------------------------------------------------------------- load and disconnect


def test_16_concurrent_requests(server: LiveServer) -> None:
    results = concurrent_chat(server, [dict(messages=[{"role": "user", "content": f"Request number {i}: count to "
                                                     "five."}], max_tokens=24, temperature=0) for i in range(16)])
    assert len(results) == 16
    assert all(text and finish in ("stop", "length") for text, finish in results)
    assert wait_until(lambda: server.engine.kv_cache_usage() == 0.0)


def _long_request(server: LiveServer, stream: bool) -> dict:
    return {"model": server.model, "prompt": PROMPT, "temperature": 0, "stream": stream, "ignore_eos": True,
            "max_tokens": server.engine.max_model_len // 2}


def test_stream_disconnect_aborts_and_frees_blocks(server: LiveServer) -> None:
    assert wait_until(lambda: server.engine.kv_cache_usage() == 0.0)
    aborted_before = metric_value(server, "specserve_request_success_total", finished_reason="abort")
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.api_url}/completions", json=_long_request(server, True)) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in received)
            assert server.engine.kv_cache_usage() > 0.0  # mid-stream: the request holds blocks
    # the connection is closed here, long before max_tokens
    assert wait_until(lambda: server.engine.kv_cache_usage() == 0.0), "disconnect did not free KV blocks"
    assert wait_until(lambda: metric_value(server, "specserve_request_success_total",
                                           finished_reason="abort") >= aborted_before + 1)


def test_non_stream_disconnect_aborts_and_frees_blocks(server: LiveServer) -> None:
    assert wait_until(lambda: server.engine.kv_cache_usage() == 0.0)
    aborted_before = metric_value(server, "specserve_request_success_total", finished_reason="abort")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.api_url}/completions", json=_long_request(server, False), timeout=0.5)
    assert wait_until(lambda: server.engine.kv_cache_usage() == 0.0), "disconnect did not free KV blocks"
    assert wait_until(lambda: metric_value(server, "specserve_request_success_total",
                                           finished_reason="abort") >= aborted_before + 1)


# ---------------------------------------------------------------------------------------------- metrics

SERIES = [
    "specserve_num_requests_running", "specserve_num_requests_waiting", "specserve_kv_cache_usage_perc",
    "specserve_request_success_total", "specserve_prompt_tokens_total", "specserve_generation_tokens_total",
    "specserve_num_preemptions_total",
    "specserve_time_to_first_token_seconds_bucket", "specserve_time_per_output_token_seconds_bucket",
    "specserve_e2e_request_latency_seconds_bucket", "specserve_request_queue_time_seconds_bucket",
    "specserve_request_prompt_tokens_bucket", "specserve_request_generation_tokens_bucket",
]


def test_metrics_exposes_every_series(server: LiveServer) -> None:
    c = client(server)
    prompt_before = metric_value(server, "specserve_prompt_tokens_total")
    gen_before = metric_value(server, "specserve_generation_tokens_total")
    ok_before = metric_value(server, "specserve_request_success_total")
    resp = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0)
    metrics = httpx.get(f"{server.base_url}/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    label = f'model_name="{server.model}"'
    lines = metrics.text.splitlines()
    for name in SERIES:
        assert any(line.startswith(name + "{") and label in line for line in lines), name
    assert wait_until(lambda: metric_value(server, "specserve_request_success_total") >= ok_before + 1)
    usage = resp.usage
    assert metric_value(server, "specserve_prompt_tokens_total") >= prompt_before + usage.prompt_tokens
    assert metric_value(server, "specserve_generation_tokens_total") >= gen_before + usage.completion_tokens
    assert metric_value(server, "specserve_e2e_request_latency_seconds_count") >= 1
