"""OpenAI wire format: chat completions, completions, models, errors (pydantic models).

Requests are validated in strict JSON mode (``parse_request``), so ``"temperature": "0.5"`` is a type error
rather than silently coerced, and every failure becomes an ``APIError`` whose ``param`` names the offending
top-level field. The server answers every validation failure with HTTP 400 (what OpenAI and vLLM do), never
FastAPI's default 422.

Supported subset: one choice (``n == 1``), no logprobs, no penalties other than 0, text content parts only.
``top_k``, ``ignore_eos`` and ``stop_token_ids`` are accepted as in vLLM (a ``top_k`` of the vocabulary size or
more keeps every token). Parameters that would change what a request gets and are not implemented (tool calling,
structured output, vLLM's ``min_p`` / ``repetition_penalty`` / ``min_tokens`` / ``structured_outputs`` /
``guided_*`` / ``allowed_token_ids``: ``UNSUPPORTED``) are refused with a 400 naming them unless they carry their
no-op value (``"tool_choice": "none"``, ``"response_format": {"type": "text"}``, ``"min_p": 0``, ...), so that a
client is never silently handed unconstrained text. Other unknown fields are ignored, as OpenAI-compatible
servers usually do. An explicit ``null`` for a field with a default (``"n": null``, ``"stream": null``, ...)
means that default, as in OpenAI's API, whose clients may send such nulls.

``speculative`` (OpenAI clients send it through ``extra_body``) overrides the server's speculative decoding for
one request: ``"off"``, or ``{"method": ..., "num_spec_tokens": ...}`` with either key optional (a missing one
keeps the server's default) and no other keys. Responses then report how speculation went in
``usage.speculative`` (``SpeculativeUsage``), absent when the request did not speculate.
"""

from __future__ import annotations

import json
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from specserve.config import MAX_NUM_SPEC_TOKENS, SPEC_METHODS
from specserve.spec.params import SpecCounters

MAX_STOP_SEQUENCES = 4


class APIError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with ``status_code``."""

    def __init__(self, message: str, *, status_code: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.type = type
        self.code = code

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# --------------------------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        """A system, developer or user message must say something (OpenAI answers 400 too); an assistant's or a
        tool's may be null."""
        if self.role in ("system", "developer", "user") and (self.content is None or self.content == []):
            raise ValueError(f"content: required for a {self.role} message")
        return self

    def text(self) -> str:
        """The content as one string; text parts are joined with newlines (as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class SpeculativeOptions(BaseModel):
    """A request's override of speculative decoding; ``None`` fields keep the server's defaults."""

    model_config = ConfigDict(extra="forbid")

    method: str | None = None  # one of config.SPEC_METHODS; "none" turns speculation off
    num_spec_tokens: int | None = Field(default=None, ge=0, le=MAX_NUM_SPEC_TOKENS)

    @field_validator("method")
    @classmethod
    def _check_method(cls, v: str | None) -> str | None:
        if v is not None and v not in SPEC_METHODS:
            raise ValueError(f"must be one of {', '.join(SPEC_METHODS)}")
        return v


SPECULATIVE_OFF = "off"

# Request fields this server does not implement -> the values that ask for nothing (accepted; so is null). Any
# other value is a 400 naming the field: ignoring it would hand the client what it did not ask for.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "min_p": (0, 0.0), "repetition_penalty": (1, 1.0), "min_tokens": (0,), "response_format": ({"type": "text"},),
    "structured_outputs": (), "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "allowed_token_ids": (), "logits_processors": ([],), "bad_words": ([],),
}
UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
}


def _is_noop(value: Any, noop: Any) -> bool:
    """``value`` asks for what ``noop`` does: equal and of the same type (``true`` is not 1); an object may also
    carry other keys set to null (``{"type": "text", "json_schema": null}``)."""
    if isinstance(noop, dict) and isinstance(value, dict):
        return all(value.get(key) == v for key, v in noop.items()) and all(
            value[key] is None for key in value.keys() - noop.keys())
    return value == noop and type(value) is type(noop)


def _refuse_unsupported(table: dict[str, tuple[Any, ...]], data: Any) -> Any:
    """The raw request ``data`` when each field of ``table`` in it is null or one of its no-op values, else the 400
    naming the first other one (an ``APIError`` passes through pydantic's validation untouched)."""
    if isinstance(data, dict):
        for name, noops in table.items():
            value = data.get(name)
            if value is not None and not any(_is_noop(value, v) for v in noops):
                raise APIError(f"{name}: not supported by this server" + (
                    f" (only {json.dumps(noops[0])} is accepted)" if noops else ""), param=name)
    return data


class _SamplingRequest(BaseModel):
    """Fields shared by chat completions and completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    speculative: SpeculativeOptions | None = None  # "off" arrives as method "none"
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = UNSUPPORTED  # refused unless null or a no-op value

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported_fields(cls, data: Any) -> Any:
        return _refuse_unsupported(cls.unsupported, data)

    @field_validator("stream", "n", "ignore_eos", "presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info: Any) -> Any:
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, v: list[int] | None) -> list[int] | None:
        if v and min(v) < 0:
            raise ValueError("token ids must be non-negative")
        return v

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v: int | None) -> int | None:
        if v is not None and v < -1:
            raise ValueError("must be -1 (disabled), 0 (disabled) or a positive integer")
        return v

    @field_validator("speculative", mode="before")
    @classmethod
    def _check_speculative(cls, v: Any) -> Any:
        if v == SPECULATIVE_OFF:
            return {"method": "none"}
        if isinstance(v, str):
            raise ValueError(f'must be "{SPECULATIVE_OFF}" or an object with "method" and/or "num_spec_tokens"')
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are supported")
        if v == "" or (isinstance(v, list) and any(s == "" for s in v)):
            raise ValueError("stop sequences must not be empty")
        return v

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, v: StreamOptions | None, info: Any) -> StreamOptions | None:
        if v is not None and not info.data.get("stream", False):
            raise ValueError("only allowed when stream is true")
        return v

    @field_validator("n")
    @classmethod
    def _check_n(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _check_penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("penalties are not supported; only 0 is accepted")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = UNSUPPORTED | UNSUPPORTED_CHAT

    @field_validator("logprobs")
    @classmethod
    def _check_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(max tokens asked for, the field that asked); max_completion_tokens wins, as in OpenAI."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: str | list[str] | list[int]) -> str | list[str] | list[int]:
        if isinstance(v, list):
            if len(v) == 0:
                raise ValueError("must not be empty")
            if isinstance(v[0], str) and len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            if isinstance(v[0], int) and min(v) < 0:
                raise ValueError("token ids must be non-negative")
        return v

    @field_validator("logprobs")
    @classmethod
    def _check_logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("echo", mode="before")
    @classmethod
    def _echo_null_is_false(cls, v: Any) -> Any:
        return False if v is None else v

    @field_validator("echo")
    @classmethod
    def _check_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("only best_of=1 is supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"


_PRIMITIVE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def _is_union_tag(part: str) -> bool:
    """pydantic names union members in ``loc`` ('str', 'list[int]', 'TextContentPart'); fields are not."""
    return part in _PRIMITIVE_TAGS or "[" in part or "-" in part or part[:1].isupper()


def _format_loc(loc: tuple[Any, ...]) -> str:
    """``('messages', 0, 'content')`` -> ``messages[0].content``; union-member tags are kept out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not out:
            out = str(part)
        elif _is_union_tag(str(part)):
            continue
        else:
            out += f".{part}"
    return out


def parse_request(model: type[_SamplingRequest], body: bytes) -> Any:
    """Validate a JSON body into ``model`` or raise a 400 ``APIError`` naming the field."""
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        if first["type"] == "json_invalid":
            raise APIError(f"Malformed JSON body: {first['msg']}", code="invalid_json") from None
        if not first["loc"]:
            raise APIError(f"Invalid request body: {first['msg']}") from None
        param = str(first["loc"][0])
        # A union yields one error per member; report the ones about the first failing field, deduplicated.
        details: list[str] = []
        for err in errors:
            if not err["loc"] or str(err["loc"][0]) != param:
                continue
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "missing":
                msg = "field required"
            line = f"{_format_loc(err['loc'])}: {msg}"
            if line not in details:
                details.append(line)
        raise APIError("; ".join(details[:3]), param=param) from None


# -------------------------------------------------------------------------------------------- responses


class SpeculativeUsage(BaseModel):
    """How one request's speculation went (vocabulary of ``spec/params.py``): ``method`` proposing up to
    ``num_spec_tokens`` tokens a step (a draft can be shorter near ``max_tokens`` or the context limit, or when
    the proposer finds nothing); ``num_drafts`` verified drafts of ``draft_tokens`` tokens in all,
    ``accepted_tokens`` of them kept; ``acceptance_histogram[n]`` counts drafts with exactly n tokens accepted,
    ``accepted_per_position[i]`` drafts whose token i was accepted."""

    method: str
    num_spec_tokens: int
    draft_tokens: int
    accepted_tokens: int
    num_drafts: int
    acceptance_rate: float | None  # accepted_tokens / draft_tokens; None before the first draft
    mean_acceptance_length: float | None  # 1 + accepted_tokens / num_drafts; None before the first draft
    acceptance_histogram: list[int]
    accepted_per_position: list[int]

    @classmethod
    def from_counters(cls, method: str, counters: SpecCounters | None,
                      num_spec_tokens: int) -> SpeculativeUsage | None:
        """The usage of a request that speculated with ``method``, ``num_spec_tokens`` a step; None when it did
        not."""
        if method == "none" or counters is None:
            return None
        return cls(method=method, num_spec_tokens=num_spec_tokens, draft_tokens=counters.num_draft_tokens,
                   accepted_tokens=counters.num_accepted_tokens, num_drafts=counters.num_drafts,
                   acceptance_rate=counters.acceptance_rate,
                   mean_acceptance_length=counters.mean_acceptance_length,
                   acceptance_histogram=list(counters.acceptance_histogram),
                   accepted_per_position=list(counters.accepted_per_pos))


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculative: SpeculativeUsage | None = None  # left out of the JSON when the request did not speculate

    @model_serializer(mode="wrap")
    def _drop_missing_speculative(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("speculative") is None:
            data.pop("speculative", None)
        return data


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    """Both the non-streaming response and each stream chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
