"""OpenAI-compatible HTTP front on vLLM's own serving layer.

    POST /v1/chat/completions  /v1/completions  /v1/responses  /v1/messages (Anthropic)
    POST /tokenize  /detokenize      GET /v1/models  /health  /metrics

vLLM's request models, chat templating, tool and reasoning parsers, structured outputs, logprobs
and response building answer every request (vllm_serving.py), so a client written for
`vllm serve` gets the same fields honoured and the same errors. What infermesh adds, per request:

- admission first (classes, breakers, shedding with Retry-After, the ladder: a degraded request
  is served by the fallback model and answered under its name), then vLLM's layer on the engine
  client of the admitted model (vllm_engine_client.py: the class's vLLM priority, coalesced
  streaming, metrics, abort on release). vLLM never sees the client's `X-Request-Id`, priority
  header or body `priority` / `request_id`: the class decides.
- response headers only once the first token (or an error) is ready, so an error before the first
  token is a real status and Envoy's per-try timeout is a TTFT deadline;
- no first token by the mesh's give-up limit (`x-infermesh-ttft-give-up-ms`), streamed or not:
  504 `ttft_deadline_exceeded` and the vLLM request aborted;
- `x-infermesh-*` headers (response_headers.identity_headers) and `usage.infermesh`;
- a client that hangs up, streaming or not, releases its vLLM request at once.

How it is laid out: `HttpFront` holds the endpoints (`build_app` only routes to them). A
generation request is parsed, checked and admitted in `HttpFront.generate`; the admitted request
is answered by `HttpFront.answer` inside `RequestLifecycle.serve` (`_Exchange`, the response the
endpoint returns), its one exit, whatever the path: an answer, vLLM's error, a refusal while it
waited, the TTFT give-up, a vanished client, a cancellation, a stream's end. The give-up itself,
in all its forms, is the lifecycle's (`first_in_time`, `result_in_time`); this module translates
what the lifecycle and vLLM's layer give into responses.

vLLM's exception handlers read the server's arguments from the request's app
(`request.app.state.args.log_error_stack`): the app carries vLLM's own `FrontendArgs`, its
defaults, as `vllm serve` sets its parsed arguments there.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from http import HTTPStatus
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .errors import BadRequest, DeadlineExceeded, PayloadTooLarge, SidecarError, Unavailable, UnknownModel
from . import internal_errors
from .lifecycle import Front, Outcome, RequestLifecycle, cancel, refuse
from .metrics import process_metrics
from .pool import Pool
from .requests import TTFT_GIVE_UP_HEADER, GenerationRequest, decimal, json_body, ttft_give_up_s
from .response_headers import identity_headers, load_report_header
from . import state_api
from .vllm_engine_client import ADMITTED, ATTEMPT, Attempt
from .vllm_serving import PoolServing

log = logging.getLogger("infermesh.sidecar.http")

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DISCARD_MAX_BYTES = 64 << 20
"""How much of an oversize body is read and thrown away before the 413 goes out."""


def _error_response(e: SidecarError, headers: dict | None = None) -> JSONResponse:
    h = dict(headers or {})
    if e.retry_after_s is not None:
        h["Retry-After"] = str(max(1, int(round(e.retry_after_s))))
    return JSONResponse(e.openai_body(), status_code=e.http_status, headers=h)


async def _discard_rest(request: Request, seen: int) -> None:
    """Read (and drop) the rest of a refused body, up to DISCARD_MAX_BYTES, so the 413 reaches a
    client still sending instead of a reset (nginx's lingering close; docs/sidecar.md)."""
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > DISCARD_MAX_BYTES:
            return


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if (n := decimal(declared)) is not None and n > limit:
        await _discard_rest(request, 0)
        raise PayloadTooLarge(f"request body of {declared} bytes is over the {limit}-byte limit")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            await _discard_rest(request, len(body))
            raise PayloadTooLarge(f"request body is over the {limit}-byte limit")
    return bytes(body)


class _VllmErrors:
    """vLLM's own answers to a request it cannot parse or serve (its exception handlers)."""

    @staticmethod
    async def validation(request: Request, errors: list) -> JSONResponse:
        """vLLM's handler of a RequestValidationError; it reads vLLM's server arguments from the
        request's app (build_app sets them)."""
        from fastapi.exceptions import RequestValidationError
        from vllm.entrypoints.serve.exception_handling.handlers.validation import validation_exception_handler

        return await validation_exception_handler(request, RequestValidationError(errors))

    @staticmethod
    def not_found(e: UnknownModel) -> JSONResponse:
        """A model not on the ladder, answered as vLLM's _check_model does (its message, NotFoundError)."""
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        err = create_error_response(f"The model `{e.model}` does not exist. Valid aliases: {', '.join(e.known)}.", err_type="NotFoundError",
                                    status_code=HTTPStatus.NOT_FOUND, param="model")
        return JSONResponse(err.model_dump(), status_code=HTTPStatus.NOT_FOUND)

    @staticmethod
    def of(exc: BaseException) -> JSONResponse:
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        err = create_error_response(exc)
        return JSONResponse(err.model_dump(), status_code=err.error.code)


PARSE_IN_THREAD_BYTES = 256 << 10
"""A body this large is parsed and validated in a thread: a 4 MiB body takes tens of ms of CPU,
which the event loop (the state endpoint, every stream) should not wait for."""

INPUT_ERRORS = (AttributeError, KeyError, IndexError, TypeError, ValueError, OverflowError, UnicodeError,
                RecursionError, NotImplementedError)
"""What vLLM's request models and its request preparation (templates, sampling parameters, the
renderer) raise on a value of the wrong shape that its validation let through; its own server
answers several of them with a 500 (an AttributeError for `structured_outputs: 5`)."""


def _bad_request(message: str, param: str | None = None) -> JSONResponse:
    """A 400 in vLLM's error form (what its handlers answer for the requests it refuses itself)."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    err = create_error_response(message, param=param)
    return JSONResponse(err.model_dump(), status_code=HTTPStatus.BAD_REQUEST)


def _validate(model: Any, data: Any) -> Any:
    from pydantic import TypeAdapter

    return model.validate_python(data) if isinstance(model, TypeAdapter) else model.model_validate(data)


def _culprit(model: Any, data: Any, limit: int = 64) -> str | None:
    """The top-level field behind an exception that escaped validation (vLLM's `before`
    validators read the raw dict and raise past pydantic, naming nothing): the first whose value
    fails its own field's type alone, else the one whose removal lets the body validate."""
    from pydantic import TypeAdapter, ValidationError

    if not isinstance(data, dict):
        return None
    keys = list(data)[:limit]
    for key in keys:
        adapter = _field_adapter(model, key) if isinstance(model, type) and isinstance(key, str) else None
        if adapter is None:
            continue
        try:
            adapter.validate_python(data[key])
        except ValidationError:
            return key
        except Exception:  # the field's own validators raised as well: it is the odd one
            return key
    if isinstance(model, TypeAdapter):
        return None
    for key in keys:
        try:
            _validate(model, {k: v for k, v in data.items() if k != key})
        except Exception:
            continue
        return key
    return None


@functools.lru_cache(maxsize=256)
def _field_adapter(model: Any, name: str) -> Any:
    from pydantic import TypeAdapter

    fields = getattr(model, "model_fields", None) or {}
    field = fields.get(name) or next((f for f in fields.values() if f.alias == name), None)
    return None if field is None else TypeAdapter(field.annotation)


def _parse_body(model: Any, body: bytes) -> Any:
    """The body as `model`, or the pydantic ValidationError / BadRequest to answer (returned, so a
    thread can hand it back)."""
    from pydantic import ValidationError
    from vllm.exceptions import VLLMValidationError

    try:
        data = json_body(body)
    except BadRequest as e:
        return e
    try:
        return _validate(model, data)
    except (ValidationError, VLLMValidationError) as e:
        return e
    except INPUT_ERRORS as e:
        field = _culprit(model, data)
        where = f"`{field}`: " if field else ""
        return BadRequest(f"{where}a value of the wrong type or shape ({type(e).__name__}: {e})",
                          param=f"body.{field}" if field else "body")


async def _parse(model: Any, request: Request, body: bytes) -> Any:
    """The body as vLLM's request model, or a 400: vLLM's own (as FastAPI's validation gives it
    there) for what vLLM refuses, one naming the field for what vLLM's server would answer with a
    500 or a plain-text error (deep nesting, lone surrogates, a validator that raised)."""
    from pydantic import ValidationError

    media = request.headers.get("content-type", "").lower().split(";", 1)[0].strip()
    if media != "application/json":
        return await _VllmErrors.validation(request, ["Unsupported Media Type: Only 'application/json' is allowed"])
    out = await asyncio.to_thread(_parse_body, model, body) if len(body) > PARSE_IN_THREAD_BYTES else _parse_body(model, body)
    if isinstance(out, BadRequest):
        if out.code == "json_invalid":  # as FastAPI's validation answers it in vLLM's server
            return await _VllmErrors.validation(
                request, [{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error", "input": {}, "ctx": {"error": out.message}}])
        return _bad_request(out.message, out.param)
    if isinstance(out, ValidationError):
        errors = [dict(err, loc=("body", *err["loc"])) for err in out.errors(include_url=False)]
        return await _VllmErrors.validation(request, errors)
    if isinstance(out, Exception):  # VLLMValidationError from a validator: vLLM's handlers' answer
        return _VllmErrors.of(out)
    return out


def _exception_answer(e: Exception, attempt: Attempt, pool: Pool, api: str) -> JSONResponse:
    """The answer to an exception out of vLLM's layer: vLLM's own for what it answers with a 4xx
    and for the engine's failures; a 400 for an input error raised while the request was prepared
    (before the engine saw it), which vLLM's server would answer with a 500; anything else is a
    bug: logged, counted, a JSON 500."""
    from vllm.exceptions import VLLMError

    if isinstance(e, SidecarError):
        if e.http_status < 500 or attempt.engine_called:
            return _error_response(e)
    else:
        resp = _VllmErrors.of(e)
        if resp.status_code < 500 or attempt.engine_called or isinstance(e, VLLMError):
            return resp
        if isinstance(e, INPUT_ERRORS):
            return _bad_request(f"the request could not be prepared ({type(e).__name__}: {e})", getattr(e, "parameter", None))
    err = internal_errors.report(pool.metrics.registry, Front.HTTP.value, api, e)
    return _error_response(err)


async def _until_disconnect(request: Request, work: Awaitable) -> tuple[bool, Any]:
    """(True, result) or, when the client hangs up first, (False, None) with `work` cancelled:
    a non-streaming request then releases its vLLM request at once (vLLM's `with_cancellation`)."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return True, task.result()
    await cancel(task)
    return False, None


def _infermesh_usage(pool: Pool, life: RequestLifecycle) -> dict:
    adm = life.admission
    return {"model": adm.engine.config.name, "degraded": adm.degraded, "degraded_reason": adm.degraded_reason or None,
            "served_by": pool.config.served_by}


def _int_field(req: Any, name: str) -> int | None:
    value = getattr(req, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class Api:
    """One generation endpoint: vLLM's request model, the serving method, how an answer is dumped."""

    def __init__(self, name: str, request_model: Any, call: Callable, dump: Callable[[Any], dict] | None = None,
                 openai_usage: bool = True):
        self.name, self.request_model, self.call = name, request_model, call
        self.dump = dump or (lambda r: r.model_dump())
        self.openai_usage = openai_usage
        """Stream chunks are OpenAI's (`usage` on a chunk without choices)."""


def _apis() -> dict[str, Api]:
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    def sse_events(gen):  # vLLM's /v1/responses router frames its events itself
        async def frames():
            async for event in gen:
                yield f"event: {getattr(event, 'type', 'unknown')}\ndata: {event.model_dump_json(indent=None, by_alias=True)}\n\n"
        return frames()

    async def responses(s, req):
        out = await s.responses.create_responses(req, None)
        return out if isinstance(out, (dict, type(None))) or hasattr(out, "model_dump") else sse_events(out)

    return {
        "chat": Api("chat", ChatCompletionRequest, lambda s, r: s.chat.create_chat_completion(r, None)),
        "completions": Api("completions", CompletionRequest, lambda s, r: s.completion.create_completion(r, None)),
        "messages": Api("messages", AnthropicMessagesRequest, lambda s, r: s.messages.create_messages(r, None),
                        dump=lambda r: r.model_dump(exclude_none=True), openai_usage=False),
        "responses": Api("responses", ResponsesRequest, responses,
                         dump=lambda r: r.model_dump(mode="json", by_alias=True), openai_usage=False),
    }


class HttpFront:
    """The HTTP front's endpoints on one pool: each a method, `build_app` only routes to them.

    A generation request is parsed and checked here (`generate`), admitted by its RequestLifecycle,
    and answered by `answer` (vLLM's layer, translated) inside `RequestLifecycle.serve`, the
    request's one exit (`_Exchange`)."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self.serving = PoolServing()
        # vLLM's request models are imported now, not on the first request (~0.5 s of imports on the
        # event loop, measured: the state endpoint stalled behind it).
        self.apis: dict[str, Api] = _apis()

    async def health(self) -> Response:
        cfg = self.pool.config
        if self.pool.ready:
            return JSONResponse({"status": "ok", "pool": cfg.pool, "served_by": cfg.served_by})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def metrics(self) -> Response:
        pool = self.pool
        pool.metrics.inflight.set(pool.inflight)
        # infermesh's own registry, then vLLM's `vllm:*` series of every loaded engine.
        vllm = process_metrics([m.prometheus for m in pool.ladder if m.engine is not None])
        return Response(generate_latest(pool.metrics.registry) + vllm, media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> Response:
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList, ModelPermission

        cards = []
        for engine in self.pool.ladder:
            if engine.engine is not None:
                cards += (await self.serving.of(engine).models.show_available_models()).data
            else:  # a fallback not loaded on this replica: listed, as the ladder has it
                cards.append(ModelCard(id=engine.config.name, root=engine.config.path, max_model_len=engine.config.max_model_len, permission=[ModelPermission()],
                                       owned_by="vllm"))
        return JSONResponse(ModelList(data=cards).model_dump())

    async def tokenization(self, request: Request, which: str) -> Response:
        from pydantic import TypeAdapter
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest

        pool = self.pool
        try:
            body = await _read_body(request, pool.config.server.max_body_bytes)
        except SidecarError as e:
            return _error_response(e)
        model = TypeAdapter(TokenizeRequest) if which == "tokenize" else DetokenizeRequest
        req = await _parse(model, request, body)
        if isinstance(req, Response):
            return req
        try:
            engine = pool.ladder.resolve(req.model)
        except UnknownModel as e:
            return _VllmErrors.not_found(e)
        if engine.engine is None:
            return _error_response(Unavailable(f"the model {engine.config.name} is still loading", retry_after_s=1))
        req.model = engine.config.name
        s = self.serving.of(engine).tokenization
        try:
            out = await (s.create_tokenize(req, None) if which == "tokenize" else s.create_detokenize(req, None))
        except Exception as e:
            return _exception_answer(e, Attempt(), pool, which)
        return JSONResponse(out.model_dump(), status_code=getattr(getattr(out, "error", None), "code", 200))

    async def generate(self, request: Request, api_name: str) -> Response:
        """Parse, check and admit a generation request; a refusal is answered here, an admitted
        request by vLLM's layer when the returned _Exchange is sent."""
        from .mesh_class import mesh_class  # the class only from the mesh's proxy (issue 28)

        api, pool = self.apis[api_name], self.pool
        cfg = pool.config
        request_class = mesh_class(cfg, request.headers, request.client)
        pool.note_bound_for(request.headers.get("x-infermesh-pool"))
        try:
            body = await _read_body(request, cfg.server.max_body_bytes)
        except SidecarError as e:
            refuse(pool, Front.HTTP, api.name, request_class, e)
            return _error_response(e)
        req = await _parse(api.request_model, request, body)
        if isinstance(req, Response):
            refuse(pool, Front.HTTP, api.name, request_class, BadRequest("invalid request"))
            return req
        # Read as vLLM's model has them: an API without the field keeps a client's extra one as
        # it came (`n: [true]` on /v1/responses), which means nothing to vLLM and nothing here.
        n = _int_field(req, "n") or 1
        if n > cfg.server.max_n:  # the pool's own limit (server.max_n), beyond vLLM's checks
            e = BadRequest(f"`n` must be at most {cfg.server.max_n} on this pool", param="n")
            refuse(pool, Front.HTTP, api.name, request_class, e)
            return _error_response(e)
        model = getattr(req, "model", None)
        ticket = GenerationRequest(model=model if isinstance(model, str) else None, n=n, request_class=request_class)
        ticket.ttft_give_up_s = ttft_give_up_s(request.headers.get(TTFT_GIVE_UP_HEADER))
        life = RequestLifecycle(pool, ticket, Front.HTTP, api.name, request.headers)
        try:
            life.admit()
        except UnknownModel as e:
            return _VllmErrors.not_found(e)
        except SidecarError as e:  # a refusal for load is when Envoy's weights most need this replica's report
            return _error_response(e, load_report_header(pool))
        return _Exchange(life, functools.partial(self.answer, request, api, req, life))

    async def answer(self, request: Request, api: Api, req: Any, life: RequestLifecycle) -> tuple[Reply, Outcome | None]:
        """vLLM's layer's answer to an admitted request, as the front sends it: the reply (built as
        it goes out: its headers carry the load then) and its outcome, None for a stream (which
        keeps the request until it has been sent)."""
        adm = life.admission
        engine = adm.engine

        def headers() -> dict:  # at the moment the response goes out (the load report is the pool's now)
            return identity_headers(self.pool, engine.config.name, adm.degraded, adm.degraded_reason)
        # vLLM's layer sees the admitted model's one name and the admission's id; its priority
        # is the class's (the engine client sets it), never the body's.
        req.model = engine.config.name
        if hasattr(req, "request_id"):
            req.request_id = ("resp_" if api.name == "responses" else "") + adm.request_id
        if hasattr(req, "priority"):
            req.priority = 0
        ADMITTED.set(life)
        attempt = Attempt()
        ATTEMPT.set(attempt)
        try:
            present, out = await _until_disconnect(request, life.result_in_time(api.call(self.serving.of(engine), req)))
        except DeadlineExceeded as e:  # no first token at its limit, or refused while it waited: vLLM aborts
            return _error_reply(e, headers)
        except Exception as e:  # vLLM's exception handlers' answer (4xx for the client's faults)
            return self._failed(e, attempt, api, headers)
        if not present:
            return _gone, Outcome()
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if isinstance(out, ErrorResponse):
            content = out.model_dump()
            if api.name == "messages":  # vLLM's Anthropic router translates its errors
                content = {"type": "error", "error": {"type": out.error.type, "message": out.error.message}}
            return (lambda: JSONResponse(content, status_code=out.error.code, headers=headers())), Outcome(status=str(out.error.code))
        if not hasattr(out, "__anext__"):
            content = api.dump(out)

            def whole() -> Response:
                if isinstance(content.get("usage"), dict):
                    content["usage"]["infermesh"] = _infermesh_usage(self.pool, life)
                return JSONResponse(content, headers=headers())
            return whole, Outcome()
        return await self._stream(request, api, out, life, headers, attempt)

    async def _stream(self, request: Request, api: Api, gen: AsyncIterator[str], life: RequestLifecycle, headers: Callable[[], dict],
                      attempt: Attempt) -> tuple[Reply, Outcome | None]:
        """A stream's answer. Headers go out with the first content (vLLM's role chunk comes with
        the first token), so an error before it is a real status; the lifecycle gives it up
        (first_in_time). vLLM's stream is closed here unless it is handed to the response."""
        streaming = False
        try:
            try:
                present, first = await _until_disconnect(request, life.first_in_time(gen))
            except DeadlineExceeded as e:  # given up: refused in line (429), the TTFT limit or the cut (503/504), vLLM aborts
                return _error_reply(e, headers)
            except Exception as e:
                return self._failed(e, attempt, api, headers)
            if not present:
                return _gone, Outcome()
            if first is None or first.startswith("data: {\"error\""):
                error = json.loads(first[6:])["error"] if first else {"message": "empty stream", "type": "InternalServerError", "code": 500}
                status = error.get("code") if isinstance(error.get("code"), int) else 500
                return (lambda: JSONResponse({"error": error}, status_code=status, headers=headers())), Outcome(status=str(status))
            usage = _infermesh_usage(self.pool, life)
            frames = _frames(first, gen, usage) if api.openai_usage else _chain(first, gen)
            streaming = True
            return (lambda: _Stream(frames, media_type="text/event-stream", headers=headers() | STREAM_HEADERS)), None
        finally:
            if not streaming:
                await gen.aclose()

    def _failed(self, e: Exception, attempt: Attempt, api: Api, headers: Callable[[], dict]) -> tuple[Reply, Outcome]:
        resp = _exception_answer(e, attempt, self.pool, api.name)

        def reply() -> Response:
            resp.headers.update(headers())
            return resp
        return reply, Outcome(status=str(resp.status_code))


Reply = Callable[[], Response]
"""An answer, built when it goes out."""


def _error_reply(e: SidecarError, headers: Callable[[], dict]) -> tuple[Reply, Outcome]:
    return (lambda: _error_response(e, headers())), Outcome(error=e)


def _gone() -> Response:
    return Response(status_code=499)


class _Exchange(Response):
    """What the endpoint returns for an admitted request: vLLM's layer runs when Starlette sends
    it, inside RequestLifecycle.serve, so the request has one exit however the exchange ends (an
    answer, an error, a vanished client, a cancellation, a stream's end)."""

    def __init__(self, life: RequestLifecycle, answer: Callable[[], Awaitable[tuple[Reply, Outcome | None]]]):
        super().__init__()
        self.life, self.answer = life, answer

    async def __call__(self, scope, receive, send) -> None:
        async def send_reply(reply: Reply) -> None:
            await reply()(scope, receive, send)

        await self.life.serve(self.answer(), send_reply)


def build_app(pool: Pool) -> FastAPI:
    front = HttpFront(pool)
    app = FastAPI(title="infermesh sidecar", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = front.serving
    # vLLM's exception handlers read its server's arguments from the app (`log_error_stack`): the
    # defaults of vLLM's own frontend arguments, stack logging off as `vllm serve` has it.
    app.state.args = _vllm_frontend_args()
    internal_errors.install(app, pool.metrics.registry, Front.HTTP.value)
    app.add_api_route("/health", front.health, methods=["GET"])
    app.add_api_route("/metrics", front.metrics, methods=["GET"])
    app.add_api_route("/v1/models", front.models, methods=["GET"])
    for path, name in [("/v1/chat/completions", "chat"), ("/v1/completions", "completions"), ("/v1/messages", "messages"),
                       ("/v1/responses", "responses")]:
        app.add_api_route(path, _route(front.generate, name), methods=["POST"])
    for name in ("tokenize", "detokenize"):
        app.add_api_route(f"/{name}", _route(front.tokenization, name), methods=["POST"])
    state_api.install(app, pool)
    return app


def _route(handler: Callable[[Request, str], Awaitable[Response]], name: str) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await handler(request, name)
    return endpoint


def _vllm_frontend_args() -> Any:
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    return FrontendArgs(log_error_stack=False)


async def _chain(first: str, gen: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for chunk in gen:
        yield chunk


def _with_infermesh(chunk: str, infermesh: dict) -> str:
    payload = json.loads(chunk[6:])
    if isinstance(payload.get("usage"), dict):
        payload["usage"]["infermesh"] = infermesh
        chunk = "data: " + json.dumps(payload, separators=(",", ":")) + "\n\n"
    return chunk


async def _frames(first: str, gen: AsyncIterator[str], infermesh: dict) -> AsyncIterator[str]:
    """vLLM's chunks as they are, `usage.infermesh` added to the usage chunk (the one without choices).
    One generator over vLLM's, not two: this runs for every streamed message."""
    if '"choices":[]' in first and '"usage":{' in first and first.startswith("data: {"):
        first = _with_infermesh(first, infermesh)
    yield first
    async for chunk in gen:
        if '"choices":[]' in chunk and '"usage":{' in chunk and chunk.startswith("data: {"):
            chunk = _with_infermesh(chunk, infermesh)
        yield chunk


class _Stream(StreamingResponse):
    """A stream whose body iterator (vLLM's generator) is closed however the response ends, also
    when the client left before the body began (Starlette then never starts it), before the
    request is released (RequestLifecycle.serve)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
