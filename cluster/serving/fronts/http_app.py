"""The OpenAI-compatible HTTP API: a FastAPI app that Ray Serve's ASGI ingress serves from each replica.

:class:`cluster.serving.fronts.app.SpecServeDeployment` builds it per replica (``__serve_build_asgi_app__``, the
late-bound form of ``serve.ingress``), so the routes close over the replica's coordinator.  Routes:

* ``GET /health``: 200 ``{"ready": true}`` once the unit is warm and its target answers, else 503 with
  ``Retry-After``; exempt from the API key (probes, load balancers).
* ``GET /v1/models``: the served model id (``cluster.app_name``).
* ``POST /v1/completions``: :class:`cluster.serving.fronts.completions.CompletionRequest`; ``"stream": true`` answers
  with server-sent events (one ``data:`` completion chunk per engine step, then ``data: [DONE]``).
* ``POST /v1/chat/completions``: :class:`cluster.serving.fronts.chat_completions.ChatRequest`, rendered with the model's chat
  template; streamed as ``chat.completion.chunk`` events.

Errors are OpenAI-shaped ``{"error": {"message", "type", "param", "code"}}``: 400 names the parameter, the
allowed range and the value; 401 without a valid key; 404 for an unknown ``model`` or route; 429 (queue
full) and 503 (a model down, not warm) with ``Retry-After: 1``; 504 past the request deadline; a 500 carries
no internals (the traceback stays in the server log); 500 and 504 carry ``x-should-retry: false``.  Statuses,
types and outcomes come from the one table, :mod:`cluster.serving.ops.error_table`.  Every refusal is counted in
``specserve_requests{outcome}``.
"""
# no ``from __future__ import annotations``: FastAPI reads the routes' annotations (Request) at run time

import asyncio
import json
import time

from cluster.errors import shown
from cluster.serving.ops.auth import Unauthenticated, bearer_token
from cluster.serving.ops.error_table import answer
from cluster.serving.fronts.chat_completions import ChatFormat, fields_from_chat
from cluster.serving.fronts.completions import CompletionFormat, fields_from_openai
from cluster.serving.fronts.http_api import model_list, oai_error, parse_body, read_body
from cluster.serving.fronts.requests import admit

RETRY_AFTER = {"Retry-After": "1"}        # seconds; /health's 503 while the unit is not ready


def json_response(obj, status: int = 200, headers: dict | None = None):
    """JSON with non-ASCII escaped, so any text (a lone surrogate echoed in an error included) encodes."""
    from starlette.responses import Response
    return Response(json.dumps(obj), status_code=status, headers=headers, media_type="application/json")


def build_http_app(dep):
    """The FastAPI app of one replica ``dep`` (its ``cfg``, ``keys`` and ``coord`` are read per request)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    app = FastAPI(title="specserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BearerAuth, dep=dep)
    created = int(time.time())

    @app.get("/health")
    async def health():
        if dep.coord.ready:
            return json_response({"ready": True})
        return json_response({"ready": False}, 503, RETRY_AFTER)

    @app.get("/v1/models")
    async def models():
        return json_response(model_list(dep.cfg.cluster.app_name, created))

    async def answer(request: Request, parse, response_format):
        """One OpenAI request: typed by ``parse``, admitted through the one request path, answered whole or
        as server-sent events with ``response_format``'s objects; any error through the one error table."""
        strategy = None
        try:
            body = parse_body(await read_body(request))         # size and nesting checked before parsing
            strategy = body.get("strategy") if isinstance(body, dict) else None
            fields, m = parse(body)
            req = await admit(dep.coord, dep.cfg, fields)          # fixes request id and seed for every chunk
            fmt = response_format(dep.cfg.cluster.app_name, req, dep.coord.engine.tokenizer, m)
            if m.stream:
                return await _sse(dep, req, fmt)
            return json_response(fmt.whole(await dep.coord.generate(req)))
        except asyncio.CancelledError:
            raise
        except Exception as e:                                     # noqa: BLE001 - mapped to a status
            return refused(dep, e, strategy)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, fields_from_openai, CompletionFormat)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, fields_from_chat, ChatFormat)

    @app.exception_handler(HTTPException)                         # no such route (404), wrong method (405)
    async def http_error(request: Request, exc: HTTPException):
        what = f"no route {shown(request.url.path)}" if exc.status_code == 404 else \
            f"{request.method} is not allowed on {shown(request.url.path)}"
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return json_response(oai_error(what, kind, None, exc.status_code), exc.status_code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return json_response(oai_error(f"invalid request: {shown(exc.errors(), 300)}", "invalid_request_error",
                                       "body", 400), 400)

    return app


def refused(dep, exc: BaseException, strategy, **extra_headers: str) -> object:
    """The OpenAI error response rendering the one error procedure's answer for ``exc``
    (:func:`cluster.serving.ops.error_table.answer`: logged and counted there)."""
    ans = answer(exc, dep.coord.metrics, strategy or dep.cfg.engine.strategy)
    headers = dict(ans.kind.headers or {}, **extra_headers)
    return json_response(oai_error(ans.message, ans.kind.openai_type, ans.param, ans.kind.http_status),
                         ans.kind.http_status, headers or None)


async def _sse(dep, req, fmt):
    """Server-sent events of ``req``'s chunks as ``fmt``'s objects, then ``data: [DONE]``.  The first chunk
    is awaited before the response starts, so a refusal at admission still gets its status code; a later
    failure ends the stream with an error event.  A client that disconnects cancels the generator, which
    stops the request and frees its state."""
    from starlette.responses import StreamingResponse
    gen = dep.coord.stream(req)
    try:
        first = await gen.__anext__()
    except StopAsyncIteration:
        raise RuntimeError(f"request {req.rid} ended before its first chunk") from None

    async def events():
        try:
            for payload in fmt.opening():
                yield f"data: {json.dumps(payload)}\n\n"
            chunk = first
            while True:
                for payload in fmt.step(chunk):
                    yield f"data: {json.dumps(payload)}\n\n"
                if chunk.finish_reason is not None:
                    break
                chunk = await gen.__anext__()
            for payload in fmt.closing():
                yield f"data: {json.dumps(payload)}\n\n"
        except Exception as e:                                     # noqa: BLE001 - the status was sent already
            err = refused(dep, e, req.strategy_name)
            yield f"data: {err.body.decode()}\n\n"
        finally:
            await gen.aclose()
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class BearerAuth:
    """ASGI middleware: without a valid ``Authorization: Bearer <key>`` every path but ``/health`` gets 401,
    before routing (so unknown paths reveal nothing either).  Keys are compared in constant time (auth.py)."""

    def __init__(self, app, dep):
        self.app, self.dep = app, dep

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.dep.keys.enabled and \
                not scope["path"].rstrip("/").endswith("/health"):
            header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
            if self.dep.keys.role(bearer_token(header)) is None:
                response = refused(self.dep, Unauthenticated(), None, **{"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
