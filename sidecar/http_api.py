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
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from http import HTTPStatus
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .errors import BadRequest, DeadlineExceeded, PayloadTooLarge, SidecarError, Unavailable, UnknownModel
from . import internal_errors
from .lifecycle import Front, RequestLifecycle
from .metrics import process_metrics
from .pool import Pool
from .requests import TTFT_GIVE_UP_HEADER, GenerationRequest, decimal, json_body, ttft_give_up_s
from .response_headers import identity_headers
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

    _state = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(log_error_stack=False))),
                             state=SimpleNamespace())

    @classmethod
    async def validation(cls, errors: list) -> JSONResponse:
        from fastapi.exceptions import RequestValidationError
        from vllm.entrypoints.serve.exception_handling.handlers.validation import validation_exception_handler

        return await validation_exception_handler(cls._state, RequestValidationError(errors))

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
        return await _VllmErrors.validation(["Unsupported Media Type: Only 'application/json' is allowed"])
    out = await asyncio.to_thread(_parse_body, model, body) if len(body) > PARSE_IN_THREAD_BYTES else _parse_body(model, body)
    if isinstance(out, BadRequest):
        if out.code == "json_invalid":  # as FastAPI's validation answers it in vLLM's server
            return await _VllmErrors.validation(
                [{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error", "input": {}, "ctx": {"error": out.message}}])
        return _bad_request(out.message, out.param)
    if isinstance(out, ValidationError):
        errors = [dict(err, loc=("body", *err["loc"])) for err in out.errors(include_url=False)]
        return await _VllmErrors.validation(errors)
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
    await _cancel(task)
    return False, None


async def _cancel(task: asyncio.Future) -> None:
    """Cancel `task` and wait until it has unwound (its vLLM generation closed)."""
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass


async def _first_token_in_time(life: RequestLifecycle, work: Awaitable, clock: Callable[[], float]) -> Any:
    """`work`'s result, or DeadlineExceeded (`work` cancelled) when the request's TTFT give-up limit
    passes before its first token: a non-streamed request sends nothing before its end, so the
    front watches the lifecycle's first token (a stream's first chunk is timed in _start_stream)."""
    if life.req.ttft_give_up_s is None:  # nothing to watch: no task of its own (one loop hop less)
        return await work
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait((task,), timeout=max(0.0, life.first_token_deadline() - clock()))
        if not task.done() and not life.first_token_seen:
            raise life.gave_up()
        return await task
    finally:
        if not task.done():
            await _cancel(task)


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


def build_app(pool: Pool) -> FastAPI:
    cfg = pool.config
    metrics = pool.metrics
    serving = PoolServing()
    # vLLM's request models are imported now, not on the first request (~0.5 s of imports on the
    # event loop, measured: the state endpoint stalled behind it).
    apis: dict[str, Api] = _apis()
    app = FastAPI(title="infermesh sidecar", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    internal_errors.install(app, metrics.registry, Front.HTTP.value)

    @app.get("/health")
    async def health() -> Response:
        if pool.ready:
            return JSONResponse({"status": "ok", "pool": cfg.pool, "served_by": cfg.served_by})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def prom() -> Response:
        metrics.inflight.set(pool.inflight)
        # infermesh's own registry, then vLLM's `vllm:*` series of every loaded engine.
        vllm = process_metrics([m.prometheus for m in pool.ladder if m.engine is not None])
        return Response(generate_latest(metrics.registry) + vllm, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> Response:
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList, ModelPermission

        cards = []
        for engine in pool.ladder:
            if engine.engine is not None:
                cards += (await serving.of(engine).models.show_available_models()).data
            else:  # a fallback not loaded on this replica: listed, as the ladder has it
                cards.append(ModelCard(id=engine.config.name, root=engine.config.path, max_model_len=engine.config.max_model_len, permission=[ModelPermission()],
                                       owned_by="vllm"))
        return JSONResponse(ModelList(data=cards).model_dump())

    async def tokenization(request: Request, which: str) -> Response:
        from pydantic import TypeAdapter
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest

        try:
            body = await _read_body(request, cfg.server.max_body_bytes)
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
        s = serving.of(engine).tokenization
        try:
            out = await (s.create_tokenize(req, None) if which == "tokenize" else s.create_detokenize(req, None))
        except Exception as e:
            return _exception_answer(e, Attempt(), pool, which)
        return JSONResponse(out.model_dump(), status_code=getattr(getattr(out, "error", None), "code", 200))

    async def generate(request: Request, api_name: str) -> Response:
        api = apis[api_name]
        from .mesh_class import mesh_class  # the class only from the mesh's proxy (issue 28)
        request_class = mesh_class(pool.config, request.headers, request.client)
        pool.note_bound_for(request.headers.get("x-infermesh-pool"))
        try:
            body = await _read_body(request, cfg.server.max_body_bytes)
        except SidecarError as e:
            pool.refuse(Front.HTTP, api.name, request_class, e)
            return _error_response(e)
        req = await _parse(api.request_model, request, body)
        if isinstance(req, Response):
            pool.refuse(Front.HTTP, api.name, request_class, BadRequest("invalid request"))
            return req
        # Read as vLLM's model has them: an API without the field keeps a client's extra one as
        # it came (`n: [true]` on /v1/responses), which means nothing to vLLM and nothing here.
        n = _int_field(req, "n") or 1
        if n > cfg.server.max_n:  # the pool's own limit (server.max_n), beyond vLLM's checks
            e = BadRequest(f"`n` must be at most {cfg.server.max_n} on this pool", param="n")
            pool.refuse(Front.HTTP, api.name, request_class, e)
            return _error_response(e)
        model = getattr(req, "model", None)
        ticket = GenerationRequest(model=model if isinstance(model, str) else None, n=n, request_class=request_class)
        ticket.ttft_give_up_s = ttft_give_up_s(request.headers.get(TTFT_GIVE_UP_HEADER))
        life = pool.lifecycle(ticket, Front.HTTP, api.name)
        try:
            adm = life.admit()
        except UnknownModel as e:
            return _VllmErrors.not_found(e)
        except SidecarError as e:
            return _error_response(e)
        return await _serve(request, api, req, life, adm)

    async def _serve(request: Request, api: Api, req: Any, life: RequestLifecycle, adm) -> Response:
        engine = adm.engine

        def headers() -> dict:  # at the moment the response goes out (the load report is the pool's now)
            return identity_headers(pool, engine.config.name, adm.degraded, adm.degraded_reason)
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
        streaming = False
        try:
            try:
                present, out = await _until_disconnect(request, _first_token_in_time(life, api.call(serving.of(engine), req), pool.clock))
            except DeadlineExceeded as e:  # a non-streamed request without a first token at its limit: vLLM aborts
                await life.close(e)
                return _error_response(e, headers())
            except Exception as e:  # vLLM's exception handlers' answer (4xx for the client's faults)
                resp = _exception_answer(e, attempt, pool, api.name)
                await life.close(status=str(resp.status_code))
                resp.headers.update(headers())
                return resp
            if not present:
                return Response(status_code=499)
            from vllm.entrypoints.serve.engine.protocol import ErrorResponse

            if isinstance(out, ErrorResponse):
                await life.close(status=str(out.error.code))
                content = out.model_dump()
                if api.name == "messages":  # vLLM's Anthropic router translates its errors
                    content = {"type": "error", "error": {"type": out.error.type, "message": out.error.message}}
                return JSONResponse(content, status_code=out.error.code, headers=headers())
            if not hasattr(out, "__anext__"):
                content = api.dump(out)
                await life.close()
                if isinstance(content.get("usage"), dict):
                    content["usage"]["infermesh"] = _infermesh_usage(pool, life)
                return JSONResponse(content, headers=headers())
            streaming = True
            return await _start_stream(request, api, out, life, headers, attempt)
        finally:
            if not streaming:
                await life.close()  # no-op once closed; a vanished client otherwise (499)

    async def _start_stream(request: Request, api: Api, gen: AsyncIterator[str], life: RequestLifecycle, headers: Callable[[], dict],
                            attempt: Attempt) -> Response:
        # Headers go out with the first content (vLLM's role chunk comes with the first token):
        # an error before it is a real status.
        if life.req.ttft_give_up_s is not None:
            first_chunk = asyncio.wait_for(_first_or_refused(gen, life), max(0.0, life.first_token_deadline() - pool.clock()))
        else:
            deadline = life.target_deadline()
            first_chunk = _first(gen) if deadline is None else _first_unless_cut(gen, life, deadline - pool.clock())
        try:
            present, first = await _until_disconnect(request, first_chunk)
        except (asyncio.TimeoutError, Refused):  # refused in line (429, at once), or the TTFT limit passed: 503/504, vLLM aborts
            await gen.aclose()
            e = life.gave_up()
            await life.close(e)
            return _error_response(e, headers())
        except Exception as e:
            await gen.aclose()
            resp = _exception_answer(e, attempt, pool, api.name)
            await life.close(status=str(resp.status_code))
            resp.headers.update(headers())
            return resp
        if not present:
            await gen.aclose()
            await life.close()
            return Response(status_code=499)
        if first is None or first.startswith("data: {\"error\""):
            await gen.aclose()
            error = json.loads(first[6:])["error"] if first else {"message": "empty stream", "type": "InternalServerError", "code": 500}
            status = error.get("code") if isinstance(error.get("code"), int) else 500
            await life.close(status=str(status))
            return JSONResponse({"error": error}, status_code=status, headers=headers())
        usage = _infermesh_usage(pool, life)
        frames = _frames(first, gen, usage) if api.openai_usage else _chain(first, gen)
        return _LifecycleStream(life, frames, media_type="text/event-stream", headers=headers() | STREAM_HEADERS)

    def route(handler: Callable[[Request, str], Awaitable[Response]], name: str) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await handler(request, name)
        return endpoint

    for path, name in [("/v1/chat/completions", "chat"), ("/v1/completions", "completions"), ("/v1/messages", "messages"),
                       ("/v1/responses", "responses")]:
        app.add_api_route(path, route(generate, name), methods=["POST"])
    for name in ("tokenize", "detokenize"):
        app.add_api_route(f"/{name}", route(tokenization, name), methods=["POST"])

    state_api.install(app, pool)
    return app


class Refused(Exception):
    """A held stream was refused while it waited for an engine slot (RequestLifecycle.refused)."""


async def _first_or_refused(gen: AsyncIterator[str], life: RequestLifecycle) -> str | None:
    """The stream's first chunk, or Refused as soon as its wait for a slot is refused (not at its
    TTFT limit: the refusal's p99 time then is the admission's, docs/breakers.md)."""
    first = asyncio.ensure_future(_first(gen))
    refused = asyncio.ensure_future(life.refused.wait())
    try:
        await asyncio.wait((first, refused), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the TTFT limit (wait_for) or a vanished client: the stream is closed after
        await _cancel(first)
        raise
    finally:
        refused.cancel()
    if first.done():
        return first.result()
    await _cancel(first)
    raise Refused


CUT_CHECK_S = 0.1
"""How often a stream past its target without a first token asks again whether it is to be cut."""


async def _first_unless_cut(gen: AsyncIterator[str], life: RequestLifecycle, after_s: float) -> str | None:
    """The stream's first chunk; asyncio.TimeoutError when, past its class's target without one,
    the lifecycle cuts it (`cut_if_pressed`; the front then answers `gave_up`). A timer, not a
    task of its own: this runs for every stream."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    cut = False
    handle: asyncio.TimerHandle | None = None

    def check() -> None:
        nonlocal cut, handle
        if life.cut_if_pressed():
            cut = True
            task.cancel()
        else:
            handle = loop.call_later(CUT_CHECK_S, check)

    handle = loop.call_later(max(0.0, after_s), check)
    try:
        return await _first(gen)
    except asyncio.CancelledError:
        if cut and task.uncancel() == 0:
            raise asyncio.TimeoutError from None
        raise
    finally:
        handle.cancel()


async def _first(gen: AsyncIterator[str]) -> str | None:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None


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


class _LifecycleStream(StreamingResponse):
    """A streaming response that releases its request however the response ends, also when the
    client left before the body began (then Starlette never starts the body iterator)."""

    def __init__(self, life: RequestLifecycle, content: AsyncIterator[str], **kwargs):
        super().__init__(content, **kwargs)
        self.life = life

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.life.close()
