"""Speculative decoding through the HTTP API, with the official ``openai`` client against a live server.

One real server (SmolLM2-135M-Instruct, fp32 on CPU) whose default is n-gram lookup with ``K`` draft tokens.
The prompt asks the model to copy a sentence, so its output repeats prompt text and n-gram drafts get accepted.
Checks: greedy text is the same with the default, with ``"speculative": "off"`` and with another
``num_spec_tokens``, streamed or not; ``usage.speculative`` is consistent and absent when the request did not
speculate; bad ``speculative`` values are 400s naming the field; /metrics exposes the ``spec_decode`` series.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from specserve.config import SpecConfig

from .conftest import LiveServer, client, live_server, make_real_async_engine, metric_value, wait_until

K = 3  # the server's default num_spec_tokens
MESSAGES = [{"role": "user", "content": "Copy this text exactly, twice, on separate lines:\n"
                                        "Roses are red, violets are blue, sugar is sweet and so are you."}]
MAX_TOKENS = 48
OFF = "off"
DEFAULT = None  # no "speculative" field: the server's default (ngram, K)


@pytest.fixture(scope="module")
def ngram_server(smollm2_gguf_path) -> Iterator[LiveServer]:
    yield from live_server(make_real_async_engine(SpecConfig(method="ngram", num_spec_tokens=K)))


def chat(server: LiveServer, speculative: Any = DEFAULT, **kwargs: Any) -> Any:
    extra_body = {} if speculative is DEFAULT else {"speculative": speculative}
    kwargs = {"max_tokens": MAX_TOKENS, "temperature": 0, **kwargs}
    return client(server).chat.completions.create(model=server.model, messages=MESSAGES, extra_body=extra_body,
                                                  **kwargs)


def spec_usage(usage: Any) -> dict[str, Any] | None:
    """``usage.speculative`` as a dict (the openai client keeps unknown fields), None when absent."""
    return None if usage is None else usage.model_dump().get("speculative")


def check_spec_usage(spec: dict[str, Any] | None, num_spec_tokens: int) -> None:
    assert spec is not None
    assert spec["method"] == "ngram"
    assert spec["num_spec_tokens"] == num_spec_tokens
    drafts, drafted, accepted = spec["num_drafts"], spec["draft_tokens"], spec["accepted_tokens"]
    assert drafts > 0 and 0 < drafted <= num_spec_tokens * drafts and 0 <= accepted <= drafted
    assert spec["acceptance_rate"] == pytest.approx(accepted / drafted)
    assert 1 <= spec["mean_acceptance_length"] <= num_spec_tokens + 1
    assert spec["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    histogram, per_position = spec["acceptance_histogram"], spec["accepted_per_position"]
    assert sum(histogram) == drafts and len(histogram) <= num_spec_tokens + 1
    assert sum(n * count for n, count in enumerate(histogram)) == accepted
    assert sum(per_position) == accepted and len(per_position) <= num_spec_tokens
    assert all(a >= b for a, b in zip(per_position, per_position[1:]))  # a later token needs the earlier ones


# ----------------------------------------------------------------------------------------- losslessness


def test_greedy_output_is_the_same_with_and_without_speculation(ngram_server: LiveServer) -> None:
    default, off, longer = (chat(ngram_server, spec) for spec in (DEFAULT, OFF, {"method": "ngram",
                                                                                 "num_spec_tokens": 5}))
    text = default.choices[0].message.content
    assert text and "Roses are red" in text
    assert off.choices[0].message.content == text
    assert longer.choices[0].message.content == text
    assert default.usage.completion_tokens == off.usage.completion_tokens == longer.usage.completion_tokens
    assert default.choices[0].finish_reason == off.choices[0].finish_reason == longer.choices[0].finish_reason


def test_completion_output_is_the_same_with_and_without_speculation(ngram_server: LiveServer) -> None:
    prompt = "A B C D A B C D A B C D A B C D"
    texts, specs = [], []
    for spec in (DEFAULT, OFF, {"num_spec_tokens": 1}):
        extra_body = {} if spec is DEFAULT else {"speculative": spec}
        resp = client(ngram_server).completions.create(model=ngram_server.model, prompt=prompt, max_tokens=24,
                                                       temperature=0, extra_body=extra_body)
        texts.append(resp.choices[0].text)
        specs.append(spec_usage(resp.usage))
    assert texts[0] and texts[0] == texts[1] == texts[2]
    check_spec_usage(specs[0], K)
    assert specs[1] is None
    check_spec_usage(specs[2], 1)


# ---------------------------------------------------------------------------------------------- usage


def test_usage_reports_speculation(ngram_server: LiveServer) -> None:
    check_spec_usage(spec_usage(chat(ngram_server).usage), K)
    check_spec_usage(spec_usage(chat(ngram_server, {"method": "ngram", "num_spec_tokens": 5}).usage), 5)
    check_spec_usage(spec_usage(chat(ngram_server, {"method": "ngram"}).usage), K)


@pytest.mark.parametrize("speculative", [OFF, {"method": "none"}, {"num_spec_tokens": 0}])
def test_no_speculative_usage_when_off(ngram_server: LiveServer, speculative: Any) -> None:
    body = {"model": ngram_server.model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
            "speculative": speculative}
    resp = httpx.post(f"{ngram_server.api_url}/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200
    usage = resp.json()["usage"]
    assert usage.get("speculative") is None
    assert usage["completion_tokens"] >= 1


def test_stream_include_usage_reports_speculation(ngram_server: LiveServer) -> None:
    full = chat(ngram_server)
    chunks = list(chat(ngram_server, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        full.choices[0].message.content
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(ch.usage is None for ch in chunks[:-1])
    check_spec_usage(spec_usage(last.usage), K)
    assert last.usage.model_dump() == full.usage.model_dump()  # greedy n-gram drafting is deterministic

    off_chunks = list(chat(ngram_server, OFF, stream=True, stream_options={"include_usage": True}))
    assert spec_usage(off_chunks[-1].usage) is None
    plain = list(chat(ngram_server, stream=True))  # no include_usage: no usage at all, as OpenAI
    assert all(ch.usage is None for ch in plain)


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("speculative, field", [
    ({"method": "bogus"}, "speculative.method"),
    ({"method": "eagle3"}, "speculative.method"),  # a valid method this server did not load
    ({"num_spec_tokens": -1}, "speculative.num_spec_tokens"),
    ({"num_spec_tokens": 99}, "speculative.num_spec_tokens"),
    ({"num_spec_tokens": 2.5}, "speculative.num_spec_tokens"),
    ({"method": "ngram", "foo": 1}, "speculative.foo"),
    ("sometimes", "speculative"),
    (3, "speculative"),
])
def test_bad_speculative_values_are_400_naming_the_field(ngram_server: LiveServer, speculative: Any,
                                                          field: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(ngram_server, speculative, max_tokens=4)
    err = info.value
    assert err.status_code == 400 and err.param == "speculative" and err.type == "invalid_request_error"
    assert err.body["message"].startswith(f"{field}: ")


def test_bad_speculative_value_on_completions(ngram_server: LiveServer) -> None:
    resp = httpx.post(f"{ngram_server.api_url}/completions", timeout=60, json={
        "model": ngram_server.model, "prompt": "hi", "speculative": {"method": "draft"}})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "speculative" and error["message"].startswith("speculative.method: ")


# --------------------------------------------------------------------------------------------- metrics


def test_metrics_expose_spec_decode_series(ngram_server: LiveServer) -> None:
    ngram = {"method": "ngram"}
    drafts_before = metric_value(ngram_server, "specserve_spec_decode_num_drafts_total", **ngram)
    requests_before = metric_value(ngram_server, "specserve_request_spec_mean_acceptance_length_count", **ngram)
    spec = spec_usage(chat(ngram_server).usage)
    check_spec_usage(spec, K)
    assert wait_until(lambda: metric_value(ngram_server, "specserve_request_spec_mean_acceptance_length_count",
                                           **ngram) >= requests_before + 1)

    drafts = metric_value(ngram_server, "specserve_spec_decode_num_drafts_total", **ngram)
    draft_tokens = metric_value(ngram_server, "specserve_spec_decode_num_draft_tokens_total", **ngram)
    accepted = metric_value(ngram_server, "specserve_spec_decode_num_accepted_tokens_total", **ngram)
    assert drafts >= drafts_before + spec["num_drafts"] > 0
    assert draft_tokens >= drafts and 0 < accepted <= draft_tokens
    per_position = "specserve_spec_decode_num_accepted_tokens_per_pos_total"
    assert metric_value(ngram_server, per_position, position="0", **ngram) > 0
    assert metric_value(ngram_server, per_position, **ngram) == accepted  # every accepted token has a position
    steps = metric_value(ngram_server, "specserve_spec_decode_emitted_tokens_per_step_count", **ngram)
    assert steps >= drafts > 0
    assert metric_value(ngram_server, "specserve_spec_decode_emitted_tokens_per_step_bucket", le="17.0",
                        **ngram) == steps
