"""The ASGI application of ``sdm-mlx serve`` (Starlette), on an :class:`~.engine.Engine`.

Routes::

    GET  /health                    {"status": "ok"}
    GET  /v1/models                 the served model
    POST /v1/chat/completions       verified chat completion (stream or not)
    POST /v1/completions            verified text completion (stream or not)
    POST /v1/verify                 {prompt | messages, completion} -> verdict, no generation
    GET  /v1/verdicts/{verdict_id}  the full per-row quantities of a verdict (as MCP ``explain``)
    POST /v1/feedback               {verdict_id, label} -> the verdict's row joins the support set (no retraining)

Every error is an OpenAI error object (:class:`~.schema.APIError`).  Model work
is queued on the engine's single thread; a stream whose client disconnects
sets a cancel flag that stops its generation at the next token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from . import responses as R
from .engine import Cancelled, Engine, UnknownVerdict
from .schema import APIError, GenerationRequest, parse_generation, parse_json, parse_verify

log = logging.getLogger("sdm_mlx.serve")
DEFAULT_MAX_BODY_BYTES = 1 << 20


async def read_json(request: Request, limit: int) -> dict:
    """The JSON object body, refusing bodies over ``limit`` bytes (413) before reading them whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                       code="request_too_large")
    body, size = bytearray(), 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        body += part
    if not body:
        raise APIError(400, "empty request body (expected a JSON object)", code="invalid_json")
    return parse_json(bytes(body))


def check_model(engine: Engine, model: str | None) -> None:
    if model is not None and model not in engine.aliases:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {engine.model_id!r}",
                       param="model", code="model_not_found")


def check_decoding(engine: Engine, req: GenerationRequest) -> None:
    """Decoding checks that must happen before a stream's 200 is sent (sampling is honoured in both modes)."""


async def run_on_model(engine: Engine, fn, *args):
    """Await ``fn(*args)`` on the model thread (ValueError -> 400, Cancelled -> 503)."""
    try:
        return await asyncio.wrap_future(engine.submit(fn, *args))
    except ValueError as e:
        raise APIError(400, str(e)) from None
    except Cancelled:
        raise APIError(503, "the server is shutting down", code="shutting_down") from None


def _live(engine: Engine, req: GenerationRequest) -> bool:
    """Stream tokens as generated only when a rejected answer is returned anyway (policy ``return``)."""
    return (req.on_reject or engine.gen.on_reject) == "return"


async def stream_events(engine: Engine, req: GenerationRequest, cid: str):
    """SSE events of one streamed completion (see :mod:`.responses`)."""
    loop, queue, cancel = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
    kind, model = req.kind, engine.model_id
    live = _live(engine, req)

    def put(item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass

    fut = engine.submit(engine.complete, req, put if live else None, cancel)
    fut.add_done_callback(lambda _: put(None))
    try:
        if kind == "chat":
            yield R.sse(R.chunk(kind, cid, model, role=True))
        while (seg := await queue.get()) is not None:
            yield R.sse(R.chunk(kind, cid, model, seg))
        try:
            result, verification, n_prompt = fut.result()
        except (ValueError, Cancelled, concurrent.futures.CancelledError) as e:
            err = (APIError(400, str(e)) if isinstance(e, ValueError)
                   else APIError(503, "the server is shutting down", code="shutting_down"))
            yield R.sse(err.body())
            yield R.DONE
            return
        if not live:
            yield R.sse(R.chunk(kind, cid, model, result.text))
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
        raise APIError(404, f"no verdict {vid!r} (unknown, or evicted from the last "
                            f"{engine.verdicts.capacity} verdicts)", param="verdict_id", code="verdict_not_found")
    return out


def _feedback_request(body: dict) -> tuple[str, object]:
    """``(verdict_id, label)`` of a ``/v1/feedback`` body (400 naming the field at fault)."""
    unknown = sorted(set(body) - {"verdict_id", "label"})
    if unknown:
        raise APIError(400, f"unknown field(s) {unknown}; /v1/feedback takes verdict_id and label", param=unknown[0])
    vid = body.get("verdict_id")
    if not isinstance(vid, str) or not vid:
        raise APIError(400, "'verdict_id' must be the verdict_id of an earlier verification", param="verdict_id")
    if "label" not in body:
        raise APIError(400, "'label' is required: true (the answer was right), false (wrong) or a class index",
                       param="label")
    return vid, body["label"]


def create_app(engine: Engine, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """The Starlette app serving ``engine`` (``max_body_bytes``: request body limit, 413 beyond)."""

    async def completions(request: Request, kind: str):
        req = parse_generation(await read_json(request, max_body_bytes), kind)
        check_model(engine, req.model)
        check_decoding(engine, req)
        cid = R.new_id(kind)
        if req.stream:
            return StreamingResponse(stream_events(engine, req, cid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        result, verification, n_prompt = await run_on_model(engine, engine.complete, req)
        body = R.completion_body(kind, cid, engine.model_id, result, verification, n_prompt)
        return JSONResponse(body, headers=R.verdict_headers(verification))

    async def chat(request: Request):
        return await completions(request, "chat")

    async def text(request: Request):
        return await completions(request, "text")

    async def verify(request: Request):
        req = parse_verify(await read_json(request, max_body_bytes))
        check_model(engine, req.model)
        verification, usage = await run_on_model(engine, engine.verify, req)
        body = {"object": "verification", "model": engine.model_id, "verification": verification, "usage": usage}
        return JSONResponse(body, headers=R.verdict_headers(verification))

    async def verdict(request: Request):
        return JSONResponse(_explained(engine, request.path_params["verdict_id"]))

    async def feedback(request: Request):
        vid, label = _feedback_request(await read_json(request, max_body_bytes))
        try:
            out = await run_on_model(engine, engine.add_feedback, vid, label, "server")
        except UnknownVerdict as e:
            raise APIError(404, str(e), param="verdict_id", code="verdict_not_found") from None
        return JSONResponse({"object": "feedback", **out})

    async def models(request: Request):
        return JSONResponse(R.models_body(engine.model_id, engine.created))

    async def health(request: Request):
        return JSONResponse({"status": "ok", "model": engine.model_id})

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", text, methods=["POST"]),
        Route("/v1/verify", verify, methods=["POST"]),
        Route("/v1/verdicts/{verdict_id}", verdict, methods=["GET"]),
        Route("/v1/feedback", feedback, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={
        APIError: _api_error, HTTPException: _http_error, Exception: _server_error})


async def _api_error(request: Request, exc: APIError):
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: HTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    msg = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(APIError(exc.status_code, msg, code=code).body(), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _server_error(request: Request, exc: Exception):
    log.exception("internal error on %s %s", request.method, request.url.path)
    return JSONResponse(APIError(500, f"internal server error: {type(exc).__name__}").body(), status_code=500)
