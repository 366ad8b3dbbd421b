"""The engine loop for the server: one thread owns the device and steps the engine; HTTP handlers talk to
it through a command queue and per-request ``asyncio.Queue`` streams.

A handler calls ``generate()`` and iterates. If it stops iterating early (client disconnect, cancellation),
the generator's ``finally`` aborts the request, which frees its KV blocks on the loop's next turn.

A failed engine step fails the requests in it and the loop goes on. Should the loop itself die (an error outside
a step: adding or aborting a request, the scheduler's bookkeeping), every waiting request gets an ``EngineError``,
later ``generate`` calls raise at once, and ``errored`` turns True, so ``/health`` answers 503 and an
orchestrator restarts the server instead of routing to one that would hang.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from specserve.engine.engine import LLMEngine
from specserve.engine.request import RequestOutput
from specserve.sampling import SamplingParams
from specserve.spec.params import SpecParams

log = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "RequestOutput", "EngineError"]


class EngineError(RuntimeError):
    """The engine failed while serving a request."""


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: asyncio.Queue
    spec: SpecParams | None = None  # None: the server's default


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics=None, model_name: str | None = None) -> None:
        self.engine = engine
        if metrics is not None:
            engine.metrics = metrics
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.model_name = model_name or engine.model_config.name
        self.max_model_len = engine.max_model_len
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._died: str | None = None  # why the loop thread died (None: alive, stopped or not started)
        self._died_lock = threading.Lock()  # orders a generate() call's command against the loop's death

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._stopping.set()
        self._commands.put(None)  # wake the loop
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    @property
    def errored(self) -> bool:
        """True once the loop thread has died of an error (not after ``shutdown``): ``/health`` answers 503."""
        return self._died is not None

    # ---- API for handlers ------------------------------------------------------------------------
    def resolve_spec(self, method: str | None = None, num_spec_tokens: int | None = None) -> SpecParams:
        """``LLMEngine.resolve_spec``: safe from any thread (it reads only what the engine fixed at start)."""
        return self.engine.resolve_spec(method, num_spec_tokens)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       spec: SpecParams | None = None) -> AsyncIterator[RequestOutput]:
        if self._thread is None:
            raise EngineError("engine loop is not running")
        stream: asyncio.Queue = asyncio.Queue()
        with self._died_lock:  # after the loop's death no command is queued: none would wait unanswered
            if self._died is not None:
                raise EngineError(f"engine loop has died: {self._died}")
            self._commands.put(_Add(request_id, list(prompt_ids), params, stream, spec))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        if self._died is None:  # a dead loop drains no queue: its requests were answered and aborted already
            self._commands.put(_Abort(request_id))

    def kv_cache_usage(self) -> float:
        return self.engine.block_manager.usage()

    # ---- the loop (engine thread) --------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finished:
            self._streams.pop(request_id, None)
        self._loop.call_soon_threadsafe(stream.put_nowait, item)

    def _handle(self, cmd) -> None:
        if isinstance(cmd, _Add):
            self._streams[cmd.request_id] = cmd.stream
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params, cmd.spec)
            except ValueError as e:
                self._deliver(cmd.request_id, e)
        elif isinstance(cmd, _Abort):
            out = self.engine.abort_request(cmd.request_id)
            self._streams.pop(cmd.request_id, None)
            if out is not None:
                log.info("aborted request %s", cmd.request_id)
                self.engine.record_idle()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # the loop is dead: answer everyone waiting, refuse the rest, report it
            log.exception("engine loop died")
            with self._died_lock:
                self._died = f"{type(e).__name__}: {e}"
            self._fail_streams(EngineError(f"engine loop has died: {self._died}"))

    def _serve(self) -> None:
        import torch
        with torch.inference_mode():
            while not self._stopping.is_set():
                block = not self.engine.has_unfinished()
                try:
                    cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
                    while True:
                        if cmd is not None:
                            self._handle(cmd)
                        cmd = self._commands.get_nowait()
                except queue.Empty:
                    pass
                if not self.engine.has_unfinished():
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:  # keep serving: fail the requests of this step, not the server
                    log.exception("engine step failed")
                    self._fail_all(EngineError(f"engine step failed: {e}"))
                    continue
                for out in outputs:
                    self._deliver(out.request_id, out)
        self._fail_all(EngineError("engine is shutting down"))

    def _fail_all(self, err: Exception) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
            self._deliver(rid, err)
        for rid in list(self._streams):
            self._deliver(rid, err)

    def _fail_streams(self, err: Exception) -> None:
        """``err`` to every request of a dead loop: those it had taken in and those still queued (commands are
        no longer queued once ``_died`` is set, so draining the queue reaches every one). Their KV blocks are
        released as far as the engine still can."""
        for rid in list(self.engine.requests):
            try:
                self.engine.abort_request(rid)
            except Exception:  # the engine's state is what killed the loop: answering the streams comes first
                log.exception("could not abort request %s of the dead engine loop", rid)
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                self._streams[cmd.request_id] = cmd.stream
        for rid in list(self._streams):
            self._deliver(rid, err)
