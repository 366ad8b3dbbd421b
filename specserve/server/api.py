"""The OpenAI-compatible HTTP API: ``build_app(async_engine, served_model_name) -> FastAPI``.

Endpoints: ``GET /health``, ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/chat/completions``,
``POST /v1/completions`` (both streamed as server-sent events when ``stream`` is true) and ``GET /metrics``
(Prometheus).

One request, in order (each step answers a 4xx ``{"error": {message, type, param, code}}`` on bad input):

1. read the body, at most ``max_request_body_bytes`` (413 beyond);
2. validate it strictly (``protocol.parse_request``): malformed JSON, wrong types and out-of-range values
   are all 400 with ``param`` naming the field, never FastAPI's 422;
3. check ``model`` (404), render the chat template and tokenize in a worker thread (chat: the template's
   text without extra special tokens; completions: the prompt with them, e.g. BOS, as vLLM does);
4. check the length: the prompt must leave room for one token (400 naming ``messages``/``prompt``) and
   prompt + ``max_tokens`` must fit ``max_model_len`` (400 naming ``max_tokens``); ``max_tokens`` defaults
   to what is left of the context;
5. resolve ``speculative`` against the methods this server loaded (``async_engine.resolve_spec``; 400 with
   ``param`` "speculative" and the message naming the sub-field, e.g. ``speculative.method: ...``);
6. iterate ``async_engine.generate``; the final output's speculation counters become ``usage.speculative``.
   Whatever ends the iteration early (client disconnect, error) closes the engine's generator and aborts
   the request, so its KV blocks are freed.

No module-level state: the engine, model name, metrics and limits live on ``app.state``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.sampling import SamplingParams
from specserve.server.metrics import ServingMetrics
from specserve.server.protocol import (
    APIError,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    SpeculativeOptions,
    SpeculativeUsage,
    UsageInfo,
    parse_request,
)
from specserve.spec.params import SpecParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
CLIENT_CLOSED_REQUEST = 499  # nginx's code; the client is gone and never reads it

T = TypeVar("T")


def build_app(async_engine: Any, served_model_name: str | None = None, *,
              metrics: ServingMetrics | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> FastAPI:
    """An app serving ``async_engine`` (an ``AsyncEngine``) under ``served_model_name``.

    ``metrics`` defaults to the engine's own ``metrics`` attribute (the ``ServingMetrics`` the engine loop
    records into); failing that, a fresh, never-updated ``ServingMetrics`` so /metrics still answers.
    The lifespan starts the engine loop inside the server's event loop and shuts it down on exit.
    """
    name = served_model_name or async_engine.model_name
    if metrics is None:
        metrics = getattr(async_engine, "metrics", None)
    if metrics is None:
        logger.warning("engine has no ServingMetrics; /metrics will export zeros")
        metrics = ServingMetrics(name, max_model_len=async_engine.max_model_len)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.shutdown()

    app = FastAPI(title="specserve", version="0.1.0", lifespan=lifespan)
    app.state.engine = async_engine
    app.state.served_model_name = name
    app.state.metrics = metrics
    app.state.max_request_body_bytes = max_request_body_bytes

    app.add_middleware(_InternalErrorJSON)
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(Exception, _internal_error_handler)

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"])
    app.add_api_route("/metrics", render_metrics, methods=["GET"])
    app.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"])
    app.add_api_route("/v1/completions", create_completion, methods=["POST"])
    return app


# ----------------------------------------------------------------------------------------------- errors


def _error_json(status_code: int, info: ErrorInfo) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status_code)


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.to_response().model_dump(), status_code=exc.status_code)


async def _http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return _error_json(exc.status_code, ErrorInfo(message=str(exc.detail), type="invalid_request_error"))


async def _validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    param = str(errors[0]["loc"][-1]) if errors and errors[0].get("loc") else None
    message = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in errors[:3])
    return _error_json(400, ErrorInfo(message=message, type="invalid_request_error", param=param))


class _InternalErrorJSON:
    """An unexpected error before the response started becomes the 500 error JSON here, inside the app.

    Starlette answers an unhandled error in its outermost middleware and then re-raises it to the server, which
    logs it a second time and closes the connection, so a keep-alive client's next request on it fails. Caught
    here, the error is logged once and the connection stays usable. An error after the response started (a
    stream) propagates: the streaming handlers report those in band themselves."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as exc:
            if started:
                raise
            await (await _internal_error_handler(Request(scope, receive), exc))(scope, receive, send)


async def _internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return _error_json(500, ErrorInfo(message=f"Internal server error: {type(exc).__name__}: {exc}",
                                      type="internal_server_error"))


# ---------------------------------------------------------------------------------------- simple routes


ENGINE_DEAD = "engine loop has died"


async def health(request: Request) -> Response:
    _check_engine_alive(request)
    return Response(status_code=200)


def _check_engine_alive(request: Request) -> None:
    """503 once the engine loop has died: from /health, and from a completion before anything is sent (streamed or
    not), so that a client or proxy retries elsewhere instead of reading a 200 stream that carries only an error."""
    if getattr(request.app.state.engine, "errored", False):
        raise APIError(ENGINE_DEAD, status_code=503, type="service_unavailable")


async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_model_card(request)])


async def retrieve_model(request: Request, model_id: str) -> ModelCard:
    """``GET /v1/models/{id}`` (the client's ``models.retrieve``): the served model's card, else 404."""
    _check_model(request, model_id)
    return _model_card(request)


def _model_card(request: Request) -> ModelCard:
    state = request.app.state
    return ModelCard(id=state.served_model_name, max_model_len=state.engine.max_model_len)


async def render_metrics(request: Request) -> Response:
    body, content_type = request.app.state.metrics.render()
    return Response(content=body, media_type=content_type)


# ----------------------------------------------------------------------------------- request preparation


@dataclass
class _Prepared:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    model: str
    stream: bool
    include_usage: bool
    created: int
    spec: SpecParams | None = None  # None: the server's default


async def _read_body(request: Request) -> bytes:
    """The raw body, refused with 413 beyond the configured size (checked before and while reading)."""
    max_bytes = request.app.state.max_request_body_bytes
    too_large = APIError(f"Request body too large: the limit is {max_bytes} bytes", status_code=413,
                         code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _check_model(request: Request, model: str | None) -> str:
    served = request.app.state.served_model_name
    if model is not None and model != served:
        raise APIError(f"The model `{model}` does not exist (this server serves `{served}`).",
                       status_code=404, param="model", code="model_not_found")
    return served


def _sampling_params(request: Request, req: ChatCompletionRequest | CompletionRequest,
                     prompt_ids: list[int], prompt_field: str) -> SamplingParams:
    """Length checks against ``max_model_len`` and the engine's ``SamplingParams`` for ``req``."""
    max_model_len = request.app.state.engine.max_model_len
    num_prompt = len(prompt_ids)
    if num_prompt == 0:
        raise APIError(f"{prompt_field}: the prompt is empty", param=prompt_field)
    if num_prompt >= max_model_len:
        raise APIError(
            f"{prompt_field}: this model's maximum context length is {max_model_len} tokens, but the "
            f"{prompt_field} has {num_prompt} tokens, leaving no room for output", param=prompt_field,
            code="context_length_exceeded")
    vocab_size = request.app.state.engine.tokenizer.vocab_size
    if req.stop_token_ids and max(req.stop_token_ids) >= vocab_size:
        raise APIError(f"stop_token_ids: token id {max(req.stop_token_ids)} is out of range (vocab size "
                       f"{vocab_size})", param="stop_token_ids")
    max_tokens, max_tokens_field = req.requested_max_tokens()
    if max_tokens is None:
        max_tokens = max_model_len - num_prompt
    elif num_prompt + max_tokens > max_model_len:
        raise APIError(
            f"{max_tokens_field}: {max_tokens} output tokens + {num_prompt} tokens in {prompt_field} exceed "
            f"this model's maximum context length of {max_model_len} tokens", param=max_tokens_field,
            code="context_length_exceeded")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            seed=req.seed,
            stop=req.stop_list(),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
        )
    except ValueError as exc:  # SamplingParams names the field before a colon
        message = str(exc)
        raise APIError(message, param=message.split(":", 1)[0] if ":" in message else None) from None


def _resolve_spec(request: Request, options: SpeculativeOptions | None) -> SpecParams | None:
    """The request's ``SpecParams``; None (the server's default) when it sent no ``speculative``."""
    if options is None:
        return None
    try:
        return request.app.state.engine.resolve_spec(options.method, options.num_spec_tokens)
    except ValueError as exc:  # "speculative.<field>: ..."
        raise APIError(str(exc), param="speculative") from None


async def _prepare_chat(request: Request) -> _Prepared:
    req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await _read_body(request))
    model = _check_model(request, req.model)
    tokenizer = request.app.state.engine.tokenizer
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                for m in req.messages]

    def render_and_encode() -> list[int]:
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as exc:
            raise APIError(f"messages: {exc}", param="messages") from None
        return tokenizer.encode(text, add_special_tokens=False)

    prompt_ids = await run_in_threadpool(render_and_encode)
    params = _sampling_params(request, req, prompt_ids, "messages")
    return _Prepared(f"chatcmpl-{uuid.uuid4().hex}", prompt_ids, params, model, req.stream,
                     req.include_usage, int(time.time()), _resolve_spec(request, req.speculative))


async def _prepare_completion(request: Request) -> _Prepared:
    req: CompletionRequest = parse_request(CompletionRequest, await _read_body(request))
    model = _check_model(request, req.model)
    tokenizer = request.app.state.engine.tokenizer
    if isinstance(req.prompt, list) and isinstance(req.prompt[0], int):
        prompt_ids = list(req.prompt)
        if max(prompt_ids) >= tokenizer.vocab_size:
            raise APIError(f"prompt: token id {max(prompt_ids)} is out of range (vocab size "
                           f"{tokenizer.vocab_size})", param="prompt")
    else:
        text = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
        # As vLLM: a raw prompt gets the tokenizer's special tokens (BOS); a chat template writes its own.
        prompt_ids = await run_in_threadpool(tokenizer.encode, text, add_special_tokens=True)
    params = _sampling_params(request, req, prompt_ids, "prompt")
    return _Prepared(f"cmpl-{uuid.uuid4().hex}", prompt_ids, params, model, req.stream,
                     req.include_usage, int(time.time()), _resolve_spec(request, req.speculative))


# ------------------------------------------------------------------------------------------- generation


@dataclass
class _Final:
    """What a response reports once generation ends: counts, finish reason, speculation."""

    num_prompt_tokens: int
    num_output_tokens: int = 0
    finish_reason: str | None = None
    speculative: SpeculativeUsage | None = None

    def update(self, out: Any) -> None:
        """Take the counts of one ``RequestOutput``; the final one carries the speculation counters."""
        self.num_prompt_tokens, self.num_output_tokens = out.num_prompt_tokens, out.num_output_tokens
        self.finish_reason = out.finish_reason
        if out.finished:
            self.speculative = SpeculativeUsage.from_counters(out.spec_method, out.spec_counters,
                                                              out.num_spec_tokens)

    def usage(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.num_prompt_tokens, completion_tokens=self.num_output_tokens,
                         total_tokens=self.num_prompt_tokens + self.num_output_tokens,
                         speculative=self.speculative)


async def _iterate(engine: Any, prep: _Prepared) -> AsyncIterator[Any]:
    """``engine.generate`` up to its finished output; closing or cancelling this aborts the request."""
    outputs = engine.generate(prep.request_id, prep.prompt_ids, prep.params, spec=prep.spec)
    finished = False
    try:
        async for out in outputs:
            finished = out.finished
            yield out
            if finished:
                break
    finally:
        if not finished:
            engine.abort(prep.request_id)
        with anyio.CancelScope(shield=True):
            await outputs.aclose()


async def _collect(engine: Any, prep: _Prepared) -> tuple[str, _Final]:
    """The whole output text and what the response reports about it."""
    parts: list[str] = []
    final = _Final(len(prep.prompt_ids))
    gen = _iterate(engine, prep)
    try:
        async for out in gen:
            parts.append(out.new_text)
            final.update(out)
    finally:
        with anyio.CancelScope(shield=True):
            await gen.aclose()
    return "".join(parts), final


async def _cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run ``work`` unless the client disconnects first (then cancel it and return None)."""
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):  # let the aborting finally blocks run
                await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


def _sse(obj: BaseModel, drop_usage: bool = False) -> str:
    """One server-sent event; ``drop_usage`` leaves the chunk's ``usage`` out (OpenAI sends ``"usage": null`` on
    every chunk only when ``stream_options.include_usage`` asked for the usage chunk)."""
    return f"data: {obj.model_dump_json(exclude={'usage'} if drop_usage else None)}\n\n"


def _sse_error(exc: Exception) -> str:
    logger.error("error while streaming", exc_info=exc)
    info = ErrorInfo(message=f"Internal server error: {type(exc).__name__}: {exc}",
                     type="internal_server_error")
    return _sse(ErrorResponse(error=info)) + "data: [DONE]\n\n"


async def _stream_chat(engine: Any, prep: _Prepared) -> AsyncGenerator[str, None]:
    def chunk(delta: DeltaMessage, finish_reason: str | None = None) -> str:
        choice = ChatCompletionStreamChoice(delta=delta, finish_reason=finish_reason)
        return _sse(ChatCompletionChunk(id=prep.request_id, created=prep.created, model=prep.model,
                                        choices=[choice]), drop_usage=not prep.include_usage)

    final = _Final(len(prep.prompt_ids))
    gen = _iterate(engine, prep)
    try:
        yield chunk(DeltaMessage(role="assistant", content=""))
        async for out in gen:
            final.update(out)
            if out.new_text:
                yield chunk(DeltaMessage(content=out.new_text))
            if out.finished:
                yield chunk(DeltaMessage(), out.finish_reason)
        if prep.include_usage:
            yield _sse(ChatCompletionChunk(id=prep.request_id, created=prep.created, model=prep.model,
                                           choices=[], usage=final.usage()))
        yield "data: [DONE]\n\n"
    except Exception as exc:  # headers are sent: report in-band, keep the server up
        yield _sse_error(exc)
    finally:
        with anyio.CancelScope(shield=True):
            await gen.aclose()


async def _stream_completion(engine: Any, prep: _Prepared) -> AsyncGenerator[str, None]:
    def chunk(text: str, finish_reason: str | None = None) -> str:
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return _sse(CompletionResponse(id=prep.request_id, created=prep.created, model=prep.model,
                                       choices=[choice]), drop_usage=not prep.include_usage)

    final = _Final(len(prep.prompt_ids))
    gen = _iterate(engine, prep)
    try:
        async for out in gen:
            final.update(out)
            if out.new_text:
                yield chunk(out.new_text)
            if out.finished:
                yield chunk("", out.finish_reason)
        if prep.include_usage:
            yield _sse(CompletionResponse(id=prep.request_id, created=prep.created, model=prep.model,
                                          choices=[], usage=final.usage()))
        yield "data: [DONE]\n\n"
    except Exception as exc:
        yield _sse_error(exc)
    finally:
        with anyio.CancelScope(shield=True):
            await gen.aclose()


class _EventStreamResponse(StreamingResponse):
    """SSE response that always closes its generator, so a disconnect aborts the request at once.

    Starlette cancels the sending task when the client disconnects; if that lands while the body generator
    is suspended at a ``yield``, the generator would be finalized only by the garbage collector.
    """

    def __init__(self, content: AsyncGenerator[str, None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = content

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()


async def create_chat_completion(request: Request) -> Response:
    _check_engine_alive(request)
    prep = await _prepare_chat(request)
    engine = request.app.state.engine
    if prep.stream:
        return _EventStreamResponse(_stream_chat(engine, prep))
    collected = await _cancel_on_disconnect(request, _collect(engine, prep))
    if collected is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    text, final = collected
    choice = ChatCompletionChoice(message=ChatResponseMessage(content=text), finish_reason=final.finish_reason)
    response = ChatCompletionResponse(id=prep.request_id, created=prep.created, model=prep.model,
                                      choices=[choice], usage=final.usage())
    return JSONResponse(response.model_dump())


async def create_completion(request: Request) -> Response:
    _check_engine_alive(request)
    prep = await _prepare_completion(request)
    engine = request.app.state.engine
    if prep.stream:
        return _EventStreamResponse(_stream_completion(engine, prep))
    collected = await _cancel_on_disconnect(request, _collect(engine, prep))
    if collected is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    text, final = collected
    choice = CompletionChoice(text=text, finish_reason=final.finish_reason)
    response = CompletionResponse(id=prep.request_id, created=prep.created, model=prep.model,
                                  choices=[choice], usage=final.usage())
    return JSONResponse(response.model_dump())
