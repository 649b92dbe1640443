"""gRPC front: infermesh.v1.Inference (Generate, ListModels), grpc.health.v1 and reflection."""

from __future__ import annotations

import logging
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .engine import Completion, EngineManager, GenerationRequest, TokenDelta
from .errors import BadRequest, SidecarError
from .metrics import SidecarMetrics
from .proto.infermesh.v1 import inference_pb2 as pb
from .proto.infermesh.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger("infermesh.sidecar.grpc")

INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
FULL_SERVICE = "infermesh.pool.full_service"
"""Health name that is SERVING only while the pool runs without any breaker action."""


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, engine: EngineManager, metrics: SidecarMetrics):
        self.engine = engine
        self.metrics = metrics

    async def ListModels(self, request, context):
        primary = self.engine.primary.config.name
        return pb.ListModelsResponse(
            models=[pb.ModelInfo(id=m.name, aliases=list(m.aliases), primary=m.name == primary) for m in self.engine.config.models]
        )

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        md = dict(context.invocation_metadata() or ())
        request_class = request.request_class or md.get("x-infermesh-class", "")
        kind = request.WhichOneof("prompt")
        req = GenerationRequest(
            model=request.model or None,
            max_tokens=request.max_tokens or None,
            temperature=request.temperature if request.HasField("temperature") else None,
            top_p=request.top_p if request.HasField("top_p") else None,
            seed=request.seed if request.HasField("seed") else None,
            stop=list(request.stop),
            request_id=request.request_id,
            request_class=request_class,
        )
        status = "OK"
        try:
            if kind == "text":
                req.prompt = request.text
            elif kind == "chat":
                req.messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
                if not req.messages:
                    raise BadRequest("chat.messages must not be empty")
            else:
                raise BadRequest("one of `text` or `chat` is required")
            adm = self.engine.admit(req)
            rid = adm.request_id
        except SidecarError as e:
            self.metrics.count_rejection("grpc", "generate", request_class, e.grpc_code.name, e)
            if e.retry_after_s is not None:
                context.set_trailing_metadata((("retry-after", str(max(1, int(round(e.retry_after_s))))),))
            await context.abort(e.grpc_code, e.message)
            return
        started = time.monotonic()
        first = True
        try:
            async for ev in self.engine.stream(req, adm):
                if isinstance(ev, TokenDelta):
                    if first:
                        self.metrics.ttft.labels("grpc", request_class).observe(time.monotonic() - started)
                        first = False
                    yield pb.GenerateResponse(request_id=rid, chunk=pb.TokenChunk(text=ev.text, token_ids=ev.token_ids))
                elif isinstance(ev, Completion):
                    self.metrics.prompt_tokens.labels(ev.model).inc(ev.prompt_tokens)
                    self.metrics.completion_tokens.labels(ev.model).inc(ev.completion_tokens)
                    context.set_trailing_metadata(
                        (
                            ("x-infermesh-model", ev.model),
                            ("x-infermesh-degraded", "true" if ev.degraded else "false"),
                            ("x-infermesh-served-by", self.engine.config.served_by),
                        )
                        + ((("x-infermesh-degraded-reason", ev.degraded_reason),) if ev.degraded_reason else ())
                    )
                    usage = pb.Usage(
                        prompt_tokens=ev.prompt_tokens,
                        completion_tokens=ev.completion_tokens,
                        total_tokens=ev.prompt_tokens + ev.completion_tokens,
                    )
                    yield pb.GenerateResponse(
                        request_id=rid,
                        final=pb.Final(
                            finish_reason=ev.finish_reason,
                            usage=usage,
                            model=ev.model,
                            degraded=ev.degraded,
                            degraded_reason=ev.degraded_reason,
                            served_by=self.engine.config.served_by,
                        ),
                    )
        except SidecarError as e:
            status = e.grpc_code.name
            await context.abort(e.grpc_code, e.message)
        except BaseException:
            status = "CANCELLED"
            raise
        finally:
            await self.engine.release(rid)
            self.metrics.requests.labels("grpc", "generate", request_class, status).inc()


async def start_grpc(engine: EngineManager, metrics: SidecarMetrics) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    cfg = engine.config.server
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", cfg.max_body_bytes),
            ("grpc.so_reuseport", 0),
        ]
    )
    pb_grpc.add_InferenceServicer_to_server(InferenceServicer(engine, metrics), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((INFERENCE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.grpc_port}")
    await server.start()
    for name in ("", INFERENCE_SERVICE, FULL_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, port
