"""The ASGI application of ``sdm-mlx serve`` (Starlette), on an :class:`~.engine.Engine`.

Routes::

    GET  /health                    {"status": "ok", "model": the served model id} (no API key needed)
    GET  /v1/models                 the served model
    POST /v1/chat/completions       verified chat completion (stream or not)
    POST /v1/completions            verified text completion (stream or not)
    POST /v1/verify                 {prompt | messages, completion} -> verdict, no generation
    GET  /v1/verdicts/{verdict_id}  the full per-row quantities of a verdict (as MCP ``explain``); with
                                    ``Accept: text/html`` (or ``/v1/verdicts/{verdict_id}.html``) its verdict page
    POST /v1/feedback               {verdict_id, label} -> the verdict's row joins the support set (no retraining)

Every error is an OpenAI error object (:class:`~.schema.APIError`): a bad request
is a 400 naming the field (a streamed one ends with an error event and ``[DONE]``),
a server fault a 5xx whose message names no file.  Who may call which route is
decided by :mod:`.guard` (Host, Origin, API key, JSON content type); the work a
request may cause is bounded by :mod:`.limits` (prompt tokens counted before any
model work, ``max_tokens`` cap, body size and read time).  Model work is queued
on the engine's single thread; a client that disconnects — streamed or not —
sets a cancel flag that stops its generation at the next token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.routing import Route

from ..decoding.sampling import GREEDY, SamplingParams
from ..errors import InputError
from ..estimator.feedback import PersistError
from . import responses as R
from .engine import Cancelled, Engine, UnknownVerdict
from .guard import AccessGuard, AccessPolicy
from .limits import PromptCounter, PromptTooLong, RequestLimits, check_max_tokens, check_prompt_tokens
from .schema import APIError, GenerationRequest, parse_generation, parse_json, parse_verify, shown

log = logging.getLogger("sdm_mlx.serve")
DEFAULT_MAX_BODY_BYTES = 1 << 20


async def read_json(request: Request, limit: int, timeout: float | None = None) -> dict:
    """The JSON object body, refusing bodies over ``limit`` bytes (413) before reading them whole, and
    bodies not received within ``timeout`` seconds (408)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                       code="request_too_large")

    async def collect() -> bytes:
        body, size = bytearray(), 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            body += part
        return bytes(body)

    try:
        body = await asyncio.wait_for(collect(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"request body not received within {timeout:g} s", code="request_timeout") from None
    if not body:
        raise APIError(400, "empty request body (expected a JSON object)", code="invalid_json")
    return parse_json(body)


def check_model(engine: Engine, model: str | None) -> None:
    if model is not None and model not in engine.aliases:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {engine.model_id!r}",
                       param="model", code="model_not_found")


def check_decoding(engine: Engine, req: GenerationRequest) -> None:
    """Decoding checks that must happen before a stream's 200 is sent (sampling is honoured in both modes):
    ``logit_bias`` names tokens of the served model's vocabulary."""
    vocab = engine.vocab_size
    outside = [t for t, _ in req.sampling.logit_bias if t >= vocab]
    if outside:
        raise APIError(400, f"'logit_bias' names token id {outside[0]}, outside the model's vocabulary "
                            f"(ids 0..{vocab - 1})", param="logit_bias")


def model_error(e: BaseException) -> APIError:
    """The API error of an exception raised by model work: a user error (ValueError) 400, a storage fault
    500 (no path), a cancellation 503, anything else 500 (logged, named by its type only)."""
    if isinstance(e, UnknownVerdict):
        return APIError(404, str(e.args[0] if e.args else e), param="verdict_id", code="verdict_not_found")
    if isinstance(e, PersistError):
        return APIError(500, str(e), code="feedback_not_saved")
    if isinstance(e, (Cancelled, concurrent.futures.CancelledError)):
        return APIError(503, "the server is shutting down", code="shutting_down")
    if isinstance(e, ValueError):
        return APIError(400, str(e)[:2000], param=getattr(e, "api_param", None), code=getattr(e, "api_code", None))
    log.error("model work failed: %r", e, exc_info=e)
    return APIError(500, f"internal server error: {type(e).__name__}")


async def run_on_model(engine: Engine, fn, *args, request: Request | None = None,
                       cancel: threading.Event | None = None):
    """Await ``fn(*args)`` on the model thread (errors mapped by :func:`model_error`).

    With ``request`` and the ``cancel`` event ``fn`` watches, a client that disconnects before the result
    is ready sets the event: the generation stops at its next token and the model thread is free.
    """
    job = asyncio.ensure_future(asyncio.wrap_future(engine.submit(fn, *args)))
    watch = request is not None and cancel is not None
    watcher = asyncio.ensure_future(wait_disconnect(request)) if watch else None
    try:
        if watcher is not None:
            await asyncio.wait({job, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not job.done():
                cancel.set()  # the client is gone: stop its generation
                raise APIError(499, "client closed the request", code="client_closed")
        return await job
    except APIError:
        raise
    except BaseException as e:
        if isinstance(e, asyncio.CancelledError) and not job.done():
            raise
        raise model_error(e) from None
    finally:
        if watcher is not None:
            watcher.cancel()


async def wait_disconnect(request: Request) -> None:
    """Return when the client of ``request`` (whose body was read) disconnects."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _live(engine: Engine, req: GenerationRequest) -> bool:
    """Stream tokens as generated only when a rejected answer is returned anyway (policy ``return``)."""
    return (req.on_reject or engine.settings.on_reject) == "return"


async def stream_events(engine: Engine, req: GenerationRequest, cid: str):
    """SSE events of one streamed completion (see :mod:`.responses`).

    Live (policy ``return``): text chunks as generated; when logprobs are asked for, released at token
    boundaries, each with the logprobs of exactly its tokens.  Otherwise the shown text comes after
    verification in one chunk with the logprobs of the shown answer (none for an abstention: the withheld
    answer never reaches the client).
    """
    loop, queue, cancel = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
    kind, model = req.kind, engine.model_id
    live = _live(engine, req)

    def put(item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass

    fut = engine.submit(engine.complete, req, (lambda text, lps: put((text, lps))) if live else None, cancel)
    fut.add_done_callback(lambda _: put(None))
    try:
        if kind == "chat":
            yield R.sse(R.chunk(kind, cid, model, role=True))
        while (item := await queue.get()) is not None:
            text, lps = item
            yield R.sse(R.chunk(kind, cid, model, text, logprobs=R.logprobs_body(kind, lps)))
        try:
            result, verification, n_prompt = fut.result()
        except BaseException as e:  # every failure ends the stream with an error event and [DONE]
            yield R.sse(model_error(e).body())
            yield R.DONE
            return
        if not live:
            yield R.sse(R.chunk(kind, cid, model, result.text, logprobs=R.shown_logprobs(kind, result)))
        yield R.sse(R.chunk(kind, cid, model, finish=R.finish_reason(result), verification=verification))
        if req.include_usage:
            yield R.sse(R.usage_chunk(kind, cid, model, R.usage(n_prompt, result.tokens)))
        yield R.DONE
    finally:
        cancel.set()  # the client went away (or we are done): stop the generation at its next token


def _explained(engine: Engine, vid: str) -> dict:
    """``/v1/verdicts/{id}``: the stored verdict's full quantities, or a 404 naming the id."""
    out = engine.explain(vid)
    if out is None:
        raise APIError(404, f"no verdict {shown(vid)} (unknown, or evicted from the last "
                            f"{engine.verdicts.capacity} verdicts)", param="verdict_id", code="verdict_not_found")
    return out


def _wants_html(request: Request) -> bool:
    """True when the client's Accept header prefers text/html to JSON (a browser)."""
    accept = request.headers.get("accept", "").lower()
    return "text/html" in accept and "application/json" not in accept.split("text/html")[0]


def _verdict_page(engine: Engine, vid: str) -> HTMLResponse:
    """The verdict page of ``vid`` (sdm_mlx.evaluation.verdict_html), or a 404 naming the id."""
    from ..evaluation.verdict_html import verdict_page

    record = engine.verdicts.get(vid)
    if record is None:
        _explained(engine, vid)  # the 404 naming the unknown (or evicted) id
    page = verdict_page(record, vid, engine.estimator)
    return HTMLResponse(page, headers={"Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'",
                                       "X-Content-Type-Options": "nosniff"})


def _feedback_request(body: dict) -> tuple[str, object]:
    """``(verdict_id, label)`` of a ``/v1/feedback`` body (400 naming the field at fault)."""
    unknown = sorted(set(body) - {"verdict_id", "label"})
    if unknown:
        raise APIError(400, f"unknown field(s) {', '.join(shown(k, 40) for k in unknown[:5])}; /v1/feedback takes "
                            "verdict_id and label", param=unknown[0][:80])
    vid = body.get("verdict_id")
    if not isinstance(vid, str) or not vid or len(vid) > 64:
        raise APIError(400, "'verdict_id' must be the verdict_id of an earlier verification", param="verdict_id")
    if "label" not in body:
        raise APIError(400, "'label' is required: true (the answer was right), false (wrong) or a class index",
                       param="label")
    return vid, body["label"]


def _prompt_field(req) -> str:
    """The request field holding its prompt: ``messages`` (chat) or ``prompt``."""
    return "messages" if req.messages else "prompt"


def _too_long(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="context_length_exceeded")


class Routes:
    """The route handlers of one app: ``engine`` behind the per-request caps ``limits``; ``sampling``: the
    server's sampling settings, for the fields a request leaves out."""

    def __init__(self, engine: Engine, limits: RequestLimits, sampling: SamplingParams = GREEDY):
        self.engine, self.limits = engine, limits
        self.counter = PromptCounter(engine, limit=limits.max_prompt_tokens)
        self.sampling = sampling

    async def body_of(self, request: Request) -> dict:
        return await read_json(request, self.limits.max_body_bytes, self.limits.body_timeout)

    async def count(self, messages, prompt, extra: str = "", template_kwargs: dict | None = None) -> int:
        """Prompt tokens (+ ``extra``), counted on the counter's thread (a chat template that fails on the
        request's ``chat_template_kwargs``: 400); :class:`~.limits.PromptTooLong` for a text whose length alone
        is over the limit (not tokenised)."""
        return await self._off_loop(self.counter.count, messages, prompt, extra, template_kwargs)

    async def prompt_ids(self, req: GenerationRequest) -> list | None:
        """The request's prompt token ids, made on the counter's thread (or None: the model thread makes
        them); :class:`~.limits.PromptTooLong` as :meth:`count`."""
        return await self._off_loop(self.counter.prompt_ids, req.messages, req.prompt, req.chat_template_kwargs)

    async def _off_loop(self, fn, *args):
        try:
            return await self.counter.off_loop(fn, *args)
        except InputError as e:
            raise APIError(400, str(e), param="chat_template_kwargs") from None

    async def check_verify_length(self, req) -> None:
        """``/v1/verify``: the prompt and the completion together within the limit, else a 400 naming the field
        at fault: the prompt (``prompt`` / ``messages``) when it is over the limit alone, else ``completion``."""
        limit, field = self.limits.max_prompt_tokens, _prompt_field(req)
        try:
            n = await self.count(req.messages, req.prompt, req.completion)
            if n <= limit:
                return
            whole = f"{n} tokens"
        except PromptTooLong as e:
            whole = f"at least {e.at_least} tokens by its length alone"
        try:
            alone = await self.count(req.messages, req.prompt)
        except PromptTooLong as e:
            raise _too_long(str(e), field) from None
        if alone > limit:
            raise _too_long(f"prompt too long ({alone} tokens, limit {limit})", field)
        raise _too_long(f"prompt too long with the completion ({whole}, of which the prompt {alone}; limit {limit})",
                        "completion")

    async def completions(self, request: Request, kind: str):
        engine = self.engine
        req = parse_generation(await self.body_of(request), kind, self.sampling)
        check_model(engine, req.model)
        check_decoding(engine, req)
        check_max_tokens(self.limits, req.max_tokens)
        try:
            req.prompt_ids = await self.prompt_ids(req)  # tokenized once, here: the model thread reuses them
            n = len(req.prompt_ids) if req.prompt_ids is not None else await self.count(
                req.messages, req.prompt, template_kwargs=req.chat_template_kwargs)
        except PromptTooLong as e:  # by its length alone, before it was tokenised
            raise _too_long(str(e), _prompt_field(req)) from None
        check_prompt_tokens(self.limits, n, _prompt_field(req))
        cid = R.new_id(kind)
        if req.stream:
            return StreamingResponse(stream_events(engine, req, cid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        cancel = threading.Event()
        result, verification, n_prompt = await run_on_model(engine, engine.complete, req, None, cancel,
                                                            request=request, cancel=cancel)
        body = R.completion_body(kind, cid, engine.model_id, result, verification, n_prompt)
        return JSONResponse(body, headers=R.verdict_headers(verification))

    async def chat(self, request: Request):
        return await self.completions(request, "chat")

    async def text(self, request: Request):
        return await self.completions(request, "text")

    async def verify(self, request: Request):
        engine = self.engine
        req = parse_verify(await self.body_of(request))
        check_model(engine, req.model)
        await self.check_verify_length(req)
        verification, usage = await run_on_model(engine, engine.verify, req)
        body = {"object": "verification", "model": engine.model_id, "verification": verification, "usage": usage}
        return JSONResponse(body, headers=R.verdict_headers(verification))

    async def verdict(self, request: Request):  # ids are "vd-<hex>": a path ending in .html asks for the page
        if request.url.path.endswith(".html") or _wants_html(request):
            return _verdict_page(self.engine, request.path_params["verdict_id"])
        return JSONResponse(_explained(self.engine, request.path_params["verdict_id"]))

    async def feedback(self, request: Request):
        vid, label = _feedback_request(await self.body_of(request))
        out = await run_on_model(self.engine, self.engine.add_feedback, vid, label, "server")
        return JSONResponse({"object": "feedback", **out})

    async def models(self, request: Request):
        return JSONResponse(R.models_body(self.engine.model_id, self.engine.created))

    async def health(self, request: Request):
        return JSONResponse({"status": "ok", "model": self.engine.model_id})

    def table(self) -> list:
        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.text, methods=["POST"]),
            Route("/v1/verify", self.verify, methods=["POST"]),
            Route("/v1/verdicts/{verdict_id}.html", self.verdict, methods=["GET"]),
            Route("/v1/verdicts/{verdict_id}", self.verdict, methods=["GET"]),
            Route("/v1/feedback", self.feedback, methods=["POST"]),
        ]


def create_app(engine: Engine, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, limits: RequestLimits | None = None,
               policy: AccessPolicy | None = None, sampling: SamplingParams = GREEDY):
    """The Starlette app serving ``engine`` behind :class:`~.guard.AccessGuard` (``policy``; default: loopback
    Hosts, no CORS, feedback refused without an API key) with the per-request caps ``limits`` (default: prompt
    tokens up to the model's context, body up to ``max_body_bytes``) and the server's ``sampling`` settings
    (``serve --temp`` ...; default greedy) for the fields a request leaves out."""
    limits = limits or RequestLimits(max_prompt_tokens=engine.context_length, max_body_bytes=max_body_bytes)
    app = Starlette(routes=Routes(engine, limits, sampling).table(), exception_handlers={
        APIError: _api_error, HTTPException: _http_error, RecursionError: _too_deep, ClientDisconnect: _client_gone,
        Exception: _server_error})
    app.state.limits = limits
    return AccessGuard(LoggedOnce(app), policy or AccessPolicy())


class LoggedOnce:
    """Starlette re-raises an exception its 500 handler (:func:`_server_error`) has answered and logged, for the
    server to log it again (uvicorn: "Exception in ASGI application" and a second traceback); an exception
    already logged ends here, so one internal error is one traceback in the log."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        except Exception as e:
            if not getattr(e, "_sdm_logged", False):
                raise


async def _api_error(request: Request, exc: APIError):
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: HTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    msg = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(APIError(exc.status_code, msg, code=code).body(), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _too_deep(request: Request, exc: RecursionError):
    return JSONResponse(APIError(400, "request is nested too deeply", code="invalid_json").body(), status_code=400)


def _where(request: Request) -> str:
    """``METHOD /path`` of a request for a log line (the path shown with escapes: no forged log lines)."""
    return f"{request.method} {ascii(request.url.path[:200])[1:-1]}"


async def _client_gone(request: Request, exc: ClientDisconnect):
    """A client that hung up before its whole request body arrived: one log line, no traceback (nobody reads the
    answer).  Before, each such connection logged "internal error" with two tracebacks (about 100 lines)."""
    log.warning("%s: the client closed the connection before its request body was received", _where(request))
    return JSONResponse(APIError(499, "client closed the request", code="client_closed").body(), status_code=499)


async def _server_error(request: Request, exc: Exception):
    log.exception("internal error on %s", _where(request))
    try:
        exc._sdm_logged = True  # LoggedOnce: not logged a second time by the server
    except AttributeError:  # an exception type without attributes: logged twice
        pass
    return JSONResponse(APIError(500, f"internal server error: {type(exc).__name__}").body(), status_code=500)
