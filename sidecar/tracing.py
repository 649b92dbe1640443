"""OpenTelemetry traces of the sidecar's requests (docs/tracing.md), off unless the config's
`tracing.otlp_endpoint` is set.

One SERVER span per admitted or refused request, a child of the `traceparent` the request came
with (Envoy's span, through the mesh; the HTTP headers or the gRPC metadata), named as the
OpenTelemetry GenAI conventions name an inference span (`{gen_ai.operation.name}
{gen_ai.request.model}`) and carrying their attributes (SEMCONV_SCHEMA, status Development) and
infermesh's own (class, rule, pool, served_by, degraded, ladder model, outcome). Its children are
the request's phases, written when it ends from the times the lifecycle measures anyway:
`infermesh.queue` (admission to vLLM: waiting for an engine slot), `infermesh.prefill` (vLLM has it, no token yet),
`infermesh.decode` (first token to last); the admission and the outcome (shed, refused, cut,
degraded, gave up) are events. vLLM's own span (`llm_request`, its tracing turned on with the
same endpoint) is a child of the sidecar's: the request's `trace_headers` carry the sidecar span's
context, so a request this sidecar does not sample is not traced in vLLM either.

Off, the lifecycle holds no span (`active()` is None) and nothing of the SDK is imported: the one
cost is a None check per request. The SDK is imported by `start` only.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infermesh.settings import TracingSettings

    from .config import SidecarConfig
    from .lifecycle import RequestLifecycle

log = logging.getLogger("infermesh.sidecar.requests")

SEMCONV_VERSION = "1.44.0"
"""The OpenTelemetry semantic conventions followed (GenAI: Development status), as the installed
opentelemetry-semantic-conventions (0.66b2) carries them."""
SEMCONV_SCHEMA = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"

SERVICE_NAME = "infermesh-sidecar"
VLLM_SERVICE_NAME = "vllm"

OPERATION = {"chat": "chat", "completions": "text_completion", "messages": "chat", "responses": "chat"}
"""gen_ai.operation.name of each API (the gRPC front's `generate`: `chat` with messages, else `text_completion`)."""

RULE_HEADER = "x-infermesh-rule"
POOL_HEADER = "x-infermesh-pool"
ATTEMPT_HEADER = "x-envoy-attempt-count"
"""Envoy's count of this request's attempts (a retry or a hedge: 2 and up)."""

_active: "SidecarTracer | None" = None


def active() -> "SidecarTracer | None":
    """The process's tracer, None while tracing is off."""
    return _active


def vllm_endpoint() -> str | None:
    """vLLM's `otlp_traces_endpoint` (its spans join the sidecar's traces), None while tracing is off."""
    return _active.otlp_url if _active is not None else None


def start(config: "SidecarConfig", exporter: Any = None) -> "SidecarTracer | None":
    """Turn tracing on for this process if the config says so (before the engines start: vLLM
    reads `vllm_endpoint`). `exporter`: a span exporter instead of OTLP (unit tests)."""
    global _active
    stop()
    if config.tracing.on:
        # vLLM's tracer names no service; its resource takes this one (the sidecar's names its own).
        os.environ.setdefault("OTEL_SERVICE_NAME", VLLM_SERVICE_NAME)
    if config.tracing.on or exporter is not None:
        _active = SidecarTracer(config, exporter)
    return _active


def stop() -> None:
    """Export what is left and turn tracing off."""
    global _active
    if _active is not None:
        _active.shutdown()
        _active = None


class SidecarTracer:
    def __init__(self, config: "SidecarConfig", exporter: Any = None):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        settings: TracingSettings = config.tracing
        self.otlp_url = f"http://{settings.otlp_endpoint}" if settings.otlp_endpoint else None
        resource = Resource.create({"service.name": SERVICE_NAME, "service.instance.id": config.served_by,
                                    "infermesh.pool": config.pool}, schema_url=SEMCONV_SCHEMA)
        self.provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=self.otlp_url, insecure=True)
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("infermesh.sidecar", schema_url=SEMCONV_SCHEMA)
        self.config = config
        self._server = SpanKind.SERVER
        self._in = set_span_in_context
        self._propagator = TraceContextTextMapPropagator()

    def begin(self, headers: Mapping[str, str] | None, front: str, api: str, clock_now: float) -> "RequestTrace":
        """The span of a request that arrived now (`clock_now`: the pool's clock), a child of the
        `traceparent` among `headers` (HTTP headers or gRPC metadata), if any."""
        # The wall clock read next to the caller's `clock_now`, before the span is made: read after
        # (its context extracted, the span started: ~0.5 ms in Python), every phase's time was
        # that much late (the tracing e2e saw decode end 0.5 ms after Envoy's attempt).
        t0_ns = time.time_ns()
        parent = self._propagator.extract(headers) if headers is not None else None
        span = self.tracer.start_span(f"infermesh.{api}", context=parent, kind=self._server)
        return RequestTrace(self, span, headers if span.is_recording() else None, front, api, clock_now, t0_ns)

    def shutdown(self) -> None:
        self.provider.shutdown()


class RequestTrace:
    """One request's span: begun when the request arrives, ended (with its phases as children)
    when the lifecycle closes it."""

    __slots__ = ("tracer", "span", "headers", "front", "api", "t0_ns", "t0_clock", "trace_headers", "trace_id")

    def __init__(self, tracer: SidecarTracer, span: Any, headers: Mapping[str, str] | None, front: str, api: str, clock_now: float,
                 t0_ns: int):
        self.tracer, self.span, self.headers, self.front, self.api = tracer, span, headers, front, api
        self.t0_ns, self.t0_clock = t0_ns, clock_now
        ctx = span.get_span_context()
        self.trace_id = f"{ctx.trace_id:032x}"
        self.trace_headers = {"traceparent": f"00-{self.trace_id}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"}
        """For vLLM's `generate(trace_headers=…)`: its span is this span's child (or, unsampled, not recorded)."""

    def _ns(self, t: float) -> int:
        """A time on the pool's clock as Unix nanoseconds."""
        return self.t0_ns + int((t - self.t0_clock) * 1e9)

    def end(self, life: "RequestLifecycle", status: str, outcome: str, error: BaseException | None = None) -> None:
        """Name, attributes, phases and outcome of the request, then the span's end."""
        span = self.span
        if not span.is_recording():
            return
        from opentelemetry.trace import Status, StatusCode

        adm, req, cfg = life.admission, life.req, self.tracer.config
        end_clock = life.pool.clock()
        operation = OPERATION.get(self.api) or ("chat" if req.messages is not None else "text_completion")
        requested = req.model or ""
        span.update_name(f"{operation} {requested}".strip())
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": requested,
            "infermesh.front": self.front,
            "infermesh.api": self.api,
            "infermesh.class": adm.request_class if adm is not None else life.label_class,
            "infermesh.pool": cfg.pool,
            "infermesh.served_by": cfg.served_by,
            "infermesh.outcome": outcome,
            "infermesh.status": status,
        }
        if req.n > 1:
            attrs["gen_ai.request.choice.count"] = req.n
        if (h := self.headers) is not None:
            for key, header in (("infermesh.rule", RULE_HEADER), ("infermesh.routed_pool", POOL_HEADER)):
                if value := h.get(header):
                    attrs[key] = value
            if (attempt := h.get(ATTEMPT_HEADER)) and attempt.isdigit():
                attrs["infermesh.attempt"] = int(attempt)
            if (routed := attrs.get("infermesh.routed_pool")) and routed != cfg.pool:
                attrs["infermesh.spilled"] = True  # Envoy sent the routed pool's request to this one (its failover)
        if isinstance(error, Exception) and getattr(error, "code", None):
            attrs["error.type"] = error.code
        if adm is not None:
            model = adm.engine.config.name
            attrs.update({
                "gen_ai.response.model": model,
                "gen_ai.response.id": adm.request_id,
                "infermesh.request_id": adm.request_id,
                "infermesh.ladder_model": model,
                "infermesh.ladder_step": next((i for i, m in enumerate(cfg.models) if m.name == model), 0),
                "infermesh.degraded": adm.degraded,
            })
            if adm.degraded_reason:
                attrs["infermesh.degraded_reason"] = adm.degraded_reason
            if life.prompt_tokens:
                attrs["gen_ai.usage.input_tokens"] = life.prompt_tokens
            attrs["gen_ai.usage.output_tokens"] = life.completion_tokens
            first = life.first_token_at
            if first is not None:
                attrs["gen_ai.server.time_to_first_token"] = first - life.admitted_at
            self._phases(life, end_clock)
            span.add_event("admitted", {"infermesh.ladder_model": model, "infermesh.degraded": adm.degraded,
                                        "infermesh.waited_in_line": adm.waiter is not None and life.submitted_at > life.admitted_at},
                           timestamp=self._ns(life.admitted_at))
        if outcome != "ok":
            span.add_event(outcome, {"infermesh.status": status}, timestamp=self._ns(end_clock))
        span.set_attributes(attrs)
        if outcome in ("error", "gave_up", "cut") or (status.isdigit() and int(status) >= 500):
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end(end_time=self._ns(end_clock))
        log.info("request", extra={"request_id": adm.request_id if adm is not None else None, "trace_id": self.trace_id,
                                   "class": attrs["infermesh.class"], "served_by": cfg.served_by,
                                   "model": attrs.get("gen_ai.response.model"), "degraded": attrs.get("infermesh.degraded"),
                                   "outcome": outcome, "status": status,
                                   "ttft_ms": round(attrs["gen_ai.server.time_to_first_token"] * 1000, 1)
                                   if "gen_ai.server.time_to_first_token" in attrs else None,
                                   "input_tokens": life.prompt_tokens, "output_tokens": life.completion_tokens})

    def _phases(self, life: "RequestLifecycle", end_clock: float) -> None:
        """The queue, prefill and decode children, from the lifecycle's measured times."""
        ctx = self.tracer._in(self.span)
        tracer = self.tracer.tracer
        admitted, submitted = life.admitted_at, life.submitted_at
        first, last = life.first_token_at, life.last_token_at
        # Admission to vLLM: the wait for an engine slot (on the gRPC front also the tokenization);
        # one that never got its slot (refused or given up in line) waited until its end.
        phases = [("infermesh.queue", admitted, submitted or end_clock)]
        if submitted:
            phases.append(("infermesh.prefill", submitted, first if first is not None else end_clock))
        if first is not None:
            # First token to last; all in one delivery (vLLM merges deltas a slow reader left), it
            # is empty. Never the release: that comes after the last byte went out, past the
            # client's (Envoy's attempt's) end (clean-clone run on 482d744: 0.5 ms past it).
            phases.append(("infermesh.decode", first, last if last is not None and last > first else first))
        for name, t0, t1 in phases:
            tracer.start_span(name, context=ctx, start_time=self._ns(t0)).end(end_time=self._ns(t1))
