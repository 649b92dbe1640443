"""OpenAI-compatible HTTP front: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.

Streams are Server-Sent Events written as tokens arrive, with `X-Accel-Buffering: no` so no
proxy holds them back. A stream's headers go out with its first token, so an error before it is a
real HTTP status and a proxy's time to headers is the time to first token. Every response says who served it: `x-infermesh-model`,
`x-infermesh-degraded`, `x-infermesh-served-by`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .errors import BadRequest, PayloadTooLarge, SidecarError
from .lifecycle import Front, RequestLifecycle
from .pool import Pool
from .requests import TTFT_GIVE_UP_HEADER, Completion, GenerationRequest, TokenDelta, ttft_give_up_s
from .response_headers import identity_headers

log = logging.getLogger("infermesh.sidecar.http")


def _error_response(e: SidecarError) -> JSONResponse:
    headers = {}
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, int(round(e.retry_after_s))))
    return JSONResponse(e.openai_body(), status_code=e.http_status, headers=headers)


DISCARD_MAX_BYTES = 64 << 20
"""How much of an oversize body is read and thrown away before the 413 goes out."""


async def _discard_rest(request: Request, seen: int) -> None:
    """Read (and drop) the rest of a refused body, up to DISCARD_MAX_BYTES, so the 413 reaches a
    client still sending instead of a reset (nginx's lingering close; docs/sidecar.md)."""
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > DISCARD_MAX_BYTES:
            return


async def _read_json(request: Request, limit: int) -> dict:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        await _discard_rest(request, 0)
        raise PayloadTooLarge(f"request body of {declared} bytes is over the {limit}-byte limit")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            await _discard_rest(request, len(body))
            raise PayloadTooLarge(f"request body is over the {limit}-byte limit")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    return data


def _opt_number(body: dict, key: str, kind: type, lo: float | None = None, hi: float | None = None) -> Any:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise BadRequest(f"`{key}` must be a {'integer' if kind is int else 'number'}", param=key)
    v = kind(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"`{key}` must be between {lo} and {hi}", param=key)
    return v


def _parse_common(body: dict, api: str, max_n: int = 1) -> GenerationRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("`model` must be a string", param="model")
    n = _opt_number(body, "n", int, 1, max_n) or 1
    max_tokens = _opt_number(body, "max_completion_tokens", int, 1) or _opt_number(body, "max_tokens", int, 1)
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise BadRequest("`stop` must be a string or a list of up to 4 strings", param="stop")
    req = GenerationRequest(
        model=model,
        max_tokens=max_tokens,
        temperature=_opt_number(body, "temperature", float, 0, 2),
        top_p=_opt_number(body, "top_p", float, 0, 1),
        seed=_opt_number(body, "seed", int),
        stop=stop,
        n=n,
        ignore_eos=body.get("ignore_eos") is True,  # vLLM's extension, for benchmarks
    )
    if api == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("`messages` must be a non-empty list", param="messages")
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"`messages[{i}]` must be an object with a `role`", param=f"messages[{i}]")
            content = m.get("content", "")
            if isinstance(content, list):  # the content-parts form: keep the text parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
            if not isinstance(content, str):
                raise BadRequest(f"`messages[{i}].content` must be a string or text parts", param=f"messages[{i}].content")
            clean.append({"role": m["role"], "content": content})
        req.messages = clean
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequest("`prompt` must be a string", param="prompt")
        req.prompt = prompt
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("`stream` must be a boolean", param="stream")
    return req


def build_app(pool: Pool) -> FastAPI:
    cfg = pool.config
    metrics = pool.metrics
    app = FastAPI(title="infermesh sidecar", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health() -> Response:
        if pool.ready:
            return JSONResponse({"status": "ok", "pool": cfg.pool, "served_by": cfg.served_by})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def prom() -> Response:
        metrics.inflight.set(pool.inflight)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> Response:
        now = int(time.time())
        data = [{"id": name, "object": "model", "created": now, "owned_by": "infermesh"} for name in pool.model_ids()]
        return JSONResponse({"object": "list", "data": data})

    async def serve(request: Request, api: str) -> Response:
        request_class = request.headers.get("x-infermesh-class", "")
        try:
            body = await _read_json(request, cfg.server.max_body_bytes)
            req = _parse_common(body, api, cfg.server.max_n)
        except SidecarError as e:
            pool.refuse(Front.HTTP, api, request_class, e)
            return _error_response(e)
        req.request_class = request_class
        req.ttft_give_up_s = ttft_give_up_s(request.headers.get(TTFT_GIVE_UP_HEADER))
        stream = bool(body.get("stream", False))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage", False)) if stream else False
        life = pool.lifecycle(req, Front.HTTP, api)
        created = int(time.time())
        if stream:
            try:
                adm = life.admit()  # before the response starts: a refusal gets its status
            except SidecarError as e:
                return _error_response(e)
            rid = ("chatcmpl-" if api == "chat" else "cmpl-") + adm.request_id
            model = adm.engine.config.name
            # Headers go out with the first token: an error before it gets its real status, and
            # Envoy's per-try timeout (which ends when headers arrive) measures time to first token.
            events = life.events()
            try:
                first = await _first_event(request, events)
            except SidecarError as e:
                await life.close(e)
                return _error_response(e)
            except ClientGone:
                await life.close()  # counted as gone (499); vLLM aborts the request
                return Response(status_code=499)
            except BaseException:
                await life.close()  # the client left (or we were cancelled): abort in vLLM
                raise
            gen = _sse(life, api, rid, created, model, include_usage, cfg.served_by, req.n, _then(first, events))
            headers = identity_headers(pool, model, adm.degraded, adm.degraded_reason)
            return _LifecycleStream(life, gen, media_type="text/event-stream",
                                    headers=headers | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        texts: dict[int, list[str]] = {i: [] for i in range(req.n)}
        try:
            async with life:
                async for ev in life.events():
                    if isinstance(ev, TokenDelta):
                        texts.setdefault(ev.index, []).append(ev.text)
        except SidecarError as e:
            return _error_response(e)
        final = life.completion
        rid = ("chatcmpl-" if api == "chat" else "cmpl-") + req.request_id
        choices = []
        for i in sorted(texts):
            content = "".join(texts[i])
            choice: dict[str, Any] = {"index": i, "finish_reason": final.finish_reasons.get(i, final.finish_reason), "logprobs": None}
            if api == "chat":
                choice["message"] = {"role": "assistant", "content": content}
            else:
                choice["text"] = content
            choices.append(choice)
        out = {
            "id": rid,
            "object": "chat.completion" if api == "chat" else "text_completion",
            "created": created,
            "model": final.model,
            "choices": choices,
            "usage": _usage(final, cfg.served_by),
        }
        return JSONResponse(out, headers=identity_headers(pool, final.model, final.degraded, final.degraded_reason))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serve(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "completions")

    return app


class _LifecycleStream(StreamingResponse):
    """A streaming response that releases its request however the response ends, also when the
    client left before the body began (then Starlette never starts the body iterator)."""

    def __init__(self, life: RequestLifecycle, content: AsyncIterator[bytes], **kwargs):
        super().__init__(content, **kwargs)
        self.life = life

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.life.close()


def _usage(final: Completion, served_by: str) -> dict:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        "infermesh": {
            "model": final.model,
            "degraded": final.degraded,
            "degraded_reason": final.degraded_reason or None,
            "served_by": served_by,
        },
    }


def delta_framer(api: str, rid: str, created: int, model: str, include_usage: bool) -> Callable[[int, str], bytes]:
    """The SSE frame of one token delta, byte for byte what `json.dumps(payload, separators=(",", ":"))`
    gives for it, with everything but the index and the text encoded once per stream.

    Streams are most of what this front writes: one frame per step per choice."""
    obj = "chat.completion.chunk" if api == "chat" else "text_completion"
    head = (
        f'data: {{"id":{json.dumps(rid)},"object":"{obj}","created":{created},"model":{json.dumps(model)},"choices":[{{"index":'
    ).encode()
    mid = b',"delta":{"content":' if api == "chat" else b',"text":'
    tail = (b"}" if api == "chat" else b"") + b',"logprobs":null,"finish_reason":null}]' + (b',"usage":null' if include_usage else b"") + b"}\n\n"
    dumps = json.dumps

    def frame(index: int, text: str) -> bytes:
        return b"".join((head, str(index).encode(), mid, dumps(text).encode(), tail))

    return frame


class ClientGone(Exception):
    """The client closed the connection before the first token (e.g. Envoy reset a losing hedge)."""


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _first_event(request: Request, events: AsyncIterator):
    """The stream's first event, or ClientGone if the client leaves first (the body is read, so the
    next ASGI message is the disconnect)."""
    nxt = asyncio.ensure_future(anext(events))
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not nxt.done():
            nxt.cancel()
            await asyncio.gather(nxt, return_exceptions=True)
    if nxt.cancelled():
        raise ClientGone()
    return nxt.result()


async def _then(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for ev in rest:
        yield ev


async def _sse(life: RequestLifecycle, api: str, rid: str, created: int, model: str, include_usage: bool, served_by: str,
               n: int, events: AsyncIterator) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if api == "chat" else "text_completion"

    def chunk(choice: dict, usage: dict | None = None) -> bytes:
        payload: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice] if choice else []}
        if include_usage:
            payload["usage"] = usage
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    delta = delta_framer(api, rid, created, model, include_usage)
    try:
        async with life:
            if api == "chat":
                for i in range(n):
                    yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
            async for ev in events:
                if isinstance(ev, TokenDelta):
                    yield delta(ev.index, ev.text)
                    continue
                for i in range(n):
                    reason = ev.finish_reasons.get(i, ev.finish_reason)
                    if api == "chat":
                        yield chunk({"index": i, "delta": {}, "logprobs": None, "finish_reason": reason})
                    else:
                        yield chunk({"index": i, "text": "", "logprobs": None, "finish_reason": reason})
                if include_usage:
                    yield chunk({}, _usage(ev, served_by))
        yield b"data: [DONE]\n\n"
    except SidecarError as e:
        # Headers are gone already: report the error in-band, as OpenAI does, and end the stream.
        yield b"data: " + json.dumps(e.openai_body()).encode() + b"\n\n"
