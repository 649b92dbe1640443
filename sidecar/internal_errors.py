"""The last resort of the sidecar's HTTP apps: an exception nothing else answered becomes a JSON
500 (OpenAI error body, type `internal_error`), logged with its traceback and counted in
`infermesh_internal_errors_total{front, api}`. Every input error has its own 4xx before this, so
a count here is a bug to fix, never a client's fault.

The counter lives on the sidecar's own registry (SidecarMetrics.registry, served on /metrics);
it is defined here rather than in metrics.py only to keep the hardening change in one place, and
can move there.
"""

from __future__ import annotations

import json
import logging
import weakref
from http import HTTPStatus
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from starlette.requests import ClientDisconnect

from .errors import SidecarError

log = logging.getLogger("infermesh.sidecar.internal")

_COUNTERS: "weakref.WeakKeyDictionary[CollectorRegistry, Counter]" = weakref.WeakKeyDictionary()


def internal_errors(registry: CollectorRegistry) -> Counter:
    """`infermesh_internal_errors_total` on `registry` (defined once per registry)."""
    counter = _COUNTERS.get(registry)
    if counter is None:
        counter = Counter("infermesh_internal_errors_total",
                          "Unexpected exceptions answered with a 500 (each one a bug), by front and API.",
                          ["front", "api"], registry=registry)
        _COUNTERS[registry] = counter
    return counter


class InternalError(SidecarError):
    openai_type = "internal_error"

    def __init__(self, exc: BaseException):
        super().__init__(f"internal error ({type(exc).__name__}); it has been logged", code="internal_error")


def report(registry: CollectorRegistry, front: str, api: str, exc: BaseException, **fields: Any) -> InternalError:
    """Log `exc` with its traceback, count it, and return the error to answer."""
    internal_errors(registry).labels(front, api).inc()
    log.error("internal error", exc_info=(type(exc), exc, exc.__traceback__),
              extra={"front": front, "api": api, "error_type": type(exc).__name__, **fields})
    return InternalError(exc)


def api_of(path: str) -> str:
    """The API label of a request path (known paths only: the label set stays bounded)."""
    if path.startswith("/admin/"):
        part = path.split("/")[2]
        return part if part in ("state", "events", "faults") else "other"
    return _APIS.get(path, "other")


_APIS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/messages": "messages",
         "/v1/responses": "responses", "/tokenize": "tokenize", "/detokenize": "detokenize", "/v1/models": "models",
         "/health": "health", "/metrics": "metrics", "/infermesh/state": "state"}


class LastResort:
    """ASGI middleware: any exception out of the app becomes a JSON 500 while the response has not
    started; once a stream has started, it gets a last `data: {"error": …}` event (vLLM's own
    in-stream error form) and ends. Either way it is logged and counted, never re-raised (uvicorn
    would log it as plain text and close the connection)."""

    def __init__(self, app, registry: CollectorRegistry, front: str, api: Any = api_of):
        self.app, self.registry, self.front, self.api = app, registry, front, api

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = ended = False
        sse = False

        async def tracking_send(message):
            nonlocal started, ended, sse
            if message["type"] == "http.response.start":
                started = True
                sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                          for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:  # the client left while its body was read: no one to answer, no bug
            return
        except Exception as exc:  # the last resort: everything else has its own answer before this
            err = report(self.registry, self.front, self.api(scope.get("path", "")), exc,
                         method=scope.get("method"), path=scope.get("path"))
            try:
                if not started:
                    body = json.dumps(err.openai_body()).encode()
                    await send({"type": "http.response.start", "status": 500,
                                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
                    await send({"type": "http.response.body", "body": body})
                elif not ended:
                    tail = (b"data: " + json.dumps(err.openai_body()).encode() + b"\n\n") if sse else b""
                    await send({"type": "http.response.body", "body": tail})
            except Exception:  # the client is gone as well: nothing left to tell it
                pass


def install(app, registry: CollectorRegistry, front: str) -> None:
    """LastResort around an app's routes, and the same answer from the app's handler of last
    resort (Starlette's outermost middleware) for anything raised outside them."""
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    async def last_resort(request, exc: Exception) -> JSONResponse:
        err = report(registry, front, api_of(request.url.path), exc, path=request.url.path)
        return JSONResponse(err.openai_body(), status_code=500)

    async def http_error(request, exc) -> JSONResponse:  # 404, 405: in the error form of every other answer (vLLM's)
        status = HTTPStatus(exc.status_code)
        return JSONResponse({"error": {"message": str(exc.detail), "type": status.phrase, "param": None, "code": status.value}},
                            status_code=status.value, headers=getattr(exc, "headers", None))

    app.add_middleware(LastResort, registry=registry, front=front)
    app.add_exception_handler(Exception, last_resort)
    app.add_exception_handler(StarletteHTTPException, http_error)
