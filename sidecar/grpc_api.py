"""gRPC front: infermesh.v1.Inference (Generate, ListModels), grpc.health.v1 and reflection."""

from __future__ import annotations

import logging
import math
import re

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from infermesh.settings import LEVEL_DOWN

from . import internal_errors
from .errors import BadRequest, SidecarError
from .events import BreakerChanged
from .lifecycle import Front, RequestLifecycle, refuse
from .mesh_class import mesh_class, mesh_pool
from .pool import Pool
from .proto.infermesh.v1 import inference_pb2 as pb
from .proto.infermesh.v1 import inference_pb2_grpc as pb_grpc
from .requests import TTFT_GIVE_UP_HEADER, GenerationRequest, TokenDelta, json_body, ttft_give_up_s
from .response_headers import identity_headers, load_report_header

log = logging.getLogger("infermesh.sidecar.grpc")

INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
FULL_SERVICE = "infermesh.pool.full_service"
"""Health name that is SERVING only while the pool runs without any breaker action."""


def below_level_service(level: int) -> str:
    """grpc.health service SERVING while the replica is below `level` (1-LEVEL_DOWN): the gRPC
    clusters' health check of a pool with `when_degraded.spill_to`, as `GET
    /infermesh/state?healthy_below=N` is the HTTP clusters' (state_api.py)."""
    return f"infermesh.pool.below_level.{level}"


BELOW_LEVEL_SERVICES = tuple(below_level_service(n) for n in range(1, LEVEL_DOWN + 1))


# vLLM's names of the fields this front calls otherwise (errors name the proto's field).
PROTO_FIELD = {"structured_outputs": "structured_output", "logprobs": "top_logprobs"}


_FLOATS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")


def _optional(request: pb.GenerateRequest, name: str):
    return getattr(request, name) if request.HasField(name) else None


def generation_request(request: pb.GenerateRequest, request_class: str, max_n: int) -> GenerationRequest:
    """The request as the pool takes it. `request_class` is the mesh's (mesh_class.py); the
    message's own `request_class` field is ignored: a caller does not choose its class."""
    for name in _FLOATS:  # NaN passes every range check (each comparison is false)
        if request.HasField(name) and not math.isfinite(getattr(request, name)):
            raise BadRequest(f"{name} must be a finite number", param=name)
    if request.top_logprobs and not request.logprobs:
        raise BadRequest("top_logprobs needs logprobs", param="top_logprobs")
    req = GenerationRequest(
        model=request.model or None,
        max_tokens=request.max_tokens or None,
        temperature=_optional(request, "temperature"),
        top_p=_optional(request, "top_p"),
        seed=_optional(request, "seed"),
        stop=list(request.stop),
        request_id=request.request_id,
        request_class=request_class,
        n=request.n or 1,
        ignore_eos=request.ignore_eos,
        presence_penalty=_optional(request, "presence_penalty"),
        frequency_penalty=_optional(request, "frequency_penalty"),
        repetition_penalty=_optional(request, "repetition_penalty"),
        top_k=_optional(request, "top_k"),
        min_p=_optional(request, "min_p"),
        min_tokens=request.min_tokens,
        stop_token_ids=list(request.stop_token_ids),
        logprobs=request.top_logprobs if request.logprobs else None,
        structured_output=structured_output(request) if request.HasField("structured_output") else None,
    )
    if req.n > max_n:
        raise BadRequest(f"n must be at most {max_n}", param="n")
    kind = request.WhichOneof("prompt")
    if kind == "text":
        req.prompt = request.text
    elif kind == "chat":
        req.messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        if not req.messages:
            raise BadRequest("chat.messages must not be empty", param="chat.messages")
    else:
        raise BadRequest("one of `text` or `chat` is required", param="prompt")
    return req


def structured_output(request: pb.GenerateRequest) -> dict:
    """The constraint as vLLM's StructuredOutputsParams keywords (vLLM checks the rest)."""
    so = request.structured_output
    kind = so.WhichOneof("constraint")
    if kind == "json_schema":
        try:  # strict JSON, bounded nesting, no lone surrogates (requests.json_body)
            schema = json_body(so.json_schema)
        except BadRequest as e:  # its message names the body: name the field instead
            field = "structured_output.json_schema"
            if e.code == "json_invalid":
                message = f"{field} is not JSON: {e.message.partition('JSON: ')[2]}"
            else:
                message = f"{field}: " + e.message.replace("`body", f"`{field}").replace("the body", "the schema")
            raise BadRequest(message, param=field, code=e.code) from None
        if not isinstance(schema, dict):
            raise BadRequest("structured_output.json_schema must be a JSON object", param="structured_output.json_schema")
        return {"json": schema}
    if kind == "regex":
        return {"regex": so.regex}
    if kind == "choice":
        return {"choice": list(so.choice.choices)}
    raise BadRequest("structured_output needs one of json_schema, regex, choice", param="structured_output")


def grpc_message(e: SidecarError) -> str:
    """The status message: an invalid argument starts with the proto field it is about."""
    if not isinstance(e, BadRequest) or not e.param:
        return e.message
    name, dot, rest = e.param.partition(".")
    field = PROTO_FIELD.get(name, name) + dot + rest
    message = e.message
    if name in PROTO_FIELD and re.match(rf"{re.escape(name)}\b", message):  # "structured_outputs.regex must …"
        message = PROTO_FIELD[name] + message[len(name):]
    return message if re.match(rf"{re.escape(field)}[ :]", message) else f"{field}: {message}"


def token_chunk(ev: TokenDelta) -> pb.TokenChunk:
    chunk = pb.TokenChunk(text=ev.text, token_ids=ev.token_ids, index=ev.index)
    for lp in ev.logprobs or ():
        chunk.logprobs.add(token_id=lp.token_id, token=lp.token, logprob=lp.logprob, rank=lp.rank,
                           top_logprobs=[pb.TopLogprob(token_id=t, token=text, logprob=v) for t, text, v in lp.top])
    return chunk


async def _abort(context: grpc.aio.ServicerContext, e: SidecarError) -> None:
    if e.retry_after_s is not None:
        context.set_trailing_metadata((("retry-after", str(max(1, int(round(e.retry_after_s))))),))
    await context.abort(e.grpc_code, grpc_message(e))


class Malformed:
    """A request message that did not parse (corrupt wire data, a string that is not UTF-8): the
    method answers INVALID_ARGUMENT (grpc's own answer would be UNKNOWN)."""

    def __init__(self, message: str, error: DecodeError):
        self.message, self.error = message, error


def _lenient(message_type):
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return Malformed(message_type.DESCRIPTOR.full_name, e)
    return parse


async def _refuse_malformed(context: grpc.aio.ServicerContext, request: Malformed) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid {request.message}: {request.error}")


def add_inference_servicer(servicer: "InferenceServicer", server: grpc.aio.Server) -> None:
    """pb_grpc.add_InferenceServicer_to_server, with request parsing that never fails the call."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(servicer.Generate, request_deserializer=_lenient(pb.GenerateRequest),
                                                         response_serializer=pb.GenerateResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(servicer.ListModels, request_deserializer=_lenient(pb.ListModelsRequest),
                                                          response_serializer=pb.ListModelsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(INFERENCE_SERVICE, handlers),))
    server.add_registered_method_handlers(INFERENCE_SERVICE, handlers)


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, pool: Pool):
        self.pool = pool

    async def ListModels(self, request, context):
        if isinstance(request, Malformed):
            await _refuse_malformed(context, request)
            return None
        primary = self.pool.primary.config.name
        return pb.ListModelsResponse(
            models=[pb.ModelInfo(id=m.name, aliases=list(m.aliases), primary=m.name == primary) for m in self.pool.config.models]
        )

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        md = dict(context.invocation_metadata() or ())
        cfg = self.pool.config
        # The class only as the mesh set it, never the message's `request_class` (mesh_class.py).
        request_class = mesh_class(cfg, md, context.peer())
        self.pool.note_bound_for(mesh_pool(cfg, md, context.peer()))
        served_by = cfg.served_by
        if isinstance(request, Malformed):
            refuse(self.pool, Front.GRPC, "generate", request_class, BadRequest("malformed request"))
            await _refuse_malformed(context, request)
            return
        try:
            req = generation_request(request, request_class, cfg.server.max_n)
            req.ttft_give_up_s = ttft_give_up_s(md.get(TTFT_GIVE_UP_HEADER))
        except SidecarError as e:
            refuse(self.pool, Front.GRPC, "generate", request_class, e)
            await _abort(context, e)
            return
        try:
            async for message in self._generate(req, context, served_by, md):
                yield message
        except SidecarError as e:
            await _abort(context, e)
        except (grpc.aio.AbortError, GeneratorExit):
            raise
        except Exception as e:  # a bug: logged, counted, and a visible INTERNAL, never grpc's bare UNKNOWN
            err = internal_errors.report(self.pool.metrics.registry, Front.GRPC.value, "generate", e)
            await context.abort(grpc.StatusCode.INTERNAL, err.message)

    async def _generate(self, req: GenerationRequest, context: grpc.aio.ServicerContext, served_by: str, md: dict[str, str]):
        async with RequestLifecycle(self.pool, req, Front.GRPC, "generate", md) as life:
            rid = life.request_id
            first = True
            async for ev in life.events():
                if first:
                    first = False
                    await context.send_initial_metadata(tuple(load_report_header(self.pool).items()))
                if isinstance(ev, TokenDelta):
                    yield pb.GenerateResponse(request_id=rid, chunk=token_chunk(ev))
                    continue
                context.set_trailing_metadata(tuple(identity_headers(self.pool, ev.model, ev.degraded, ev.degraded_reason,
                                                                     load_report=False).items()))
                usage = pb.Usage(prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens,
                                 total_tokens=ev.prompt_tokens + ev.completion_tokens)
                yield pb.GenerateResponse(
                    request_id=rid,
                    final=pb.Final(
                        finish_reason=ev.finish_reason, usage=usage, model=ev.model, degraded=ev.degraded,
                        degraded_reason=ev.degraded_reason, served_by=served_by,
                        finish_reasons=[ev.finish_reasons.get(i, ev.finish_reason) for i in range(req.n)],
                    ),
                )


def pool_state_pb(state: dict) -> pb.PoolState:
    return pb.PoolState(
        pool=state["pool"], served_by=state["served_by"], ready=state["ready"], draining=state["draining"],
        level=state["level"], actions=state["actions"], serving_model=state["serving_model"],
        primary_model=state["primary_model"], in_flight=state["in_flight"],
        breakers=[
            pb.BreakerState(name=b["name"], signal=b["signal"], state=b["state"], actions=b["actions"], value=b["value"],
                            trip_above=b["trip_above"], recover_below=b["recover_below"])
            for b in state["breakers"]
        ],
    )


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, pool: Pool):
        self.pool = pool

    async def GetState(self, request, context):
        return pool_state_pb(self.pool.state())

    async def WatchState(self, request, context):
        with self.pool.events.watch() as q:
            yield pb.PoolEvent(state=pool_state_pb(self.pool.state()))
            while True:
                ev = await q.get()
                if not isinstance(ev, BreakerChanged):  # e.g. draining: the whole state
                    yield pb.PoolEvent(state=pool_state_pb(self.pool.state()))
                    continue
                yield pb.PoolEvent(
                    transition=pb.BreakerTransition(
                        at_unix=ev.at, breaker=ev.breaker, from_state=ev.from_state, to_state=ev.to_state,
                        actions=ev.actions, pool_actions=ev.pool_actions, serving_model=ev.serving_model, reason=ev.reason,
                    )
                )


async def start_admin_grpc(pool: Pool) -> tuple[grpc.aio.Server, int]:
    """The admin gRPC server: its own port on the admin host (loopback by default)."""
    cfg = pool.config.admin
    server = grpc.aio.server()
    pb_grpc.add_AdminServicer_to_server(AdminServicer(pool), server)
    admin_service = pb.DESCRIPTOR.services_by_name["Admin"].full_name
    reflection.enable_server_reflection((admin_service, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.grpc_port}")
    await server.start()
    return server, port


async def start_grpc(pool: Pool) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    cfg = pool.config.server
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", cfg.max_body_bytes),
            ("grpc.so_reuseport", 0),
        ]
    )
    add_inference_servicer(InferenceServicer(pool), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((INFERENCE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.grpc_port}")
    await server.start()
    for name in ("", INFERENCE_SERVICE, FULL_SERVICE, *BELOW_LEVEL_SERVICES):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, port
