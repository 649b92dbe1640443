"""The pool's vLLM engines: one AsyncLLM per model of the ladder, and the ladder itself (which
model serves new requests, vLLM's sleep mode for the primary while the pool is degraded).

vLLM is imported only where an engine is started or fed, so the rest of the sidecar (and its
unit tests) load without it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

from . import tracing
from .config import ConfigError, ModelConfig
from .errors import BadRequest, EngineFailed, UnknownModel
from .monitors import EngineStats
from .requests import Completion, GenerationRequest, TokenDelta, TokenLogprob

log = logging.getLogger("infermesh.sidecar.engines")


class _StatsLogger:
    """A vLLM stat logger that keeps the latest scheduler stats for the monitors, and the KV
    cache's size in tokens (monitors.KvCache weighs each engine's use by it)."""

    def __init__(self, sink: EngineStats, vllm_config=None):
        self.sink = sink
        self.vllm_config = vllm_config
        self._learn_capacity()

    def _learn_capacity(self) -> None:
        # vLLM's client fills num_gpu_blocks in from the engine core's handshake, before it makes
        # the stat loggers; read again at the next step should it not have.
        cache = getattr(self.vllm_config, "cache_config", None)
        blocks, block_size = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
        if blocks and block_size:
            self.sink.kv_capacity_tokens = int(blocks) * int(block_size)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if scheduler_stats is not None:
            if self.sink.kv_capacity_tokens is None:
                self._learn_capacity()
            self.sink.record(scheduler_stats.kv_cache_usage, scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs)

    def log_engine_initialized(self):
        pass

    def log(self):
        pass

    def record_sleep_state(self, is_awake: int, level: int):
        pass


def _child_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


class ModelEngine:
    """One vLLM AsyncLLM serving one model of the ladder."""

    def __init__(self, config: ModelConfig, priority_scheduling: bool = False):
        self.config = config
        self.priority_scheduling = priority_scheduling
        self.engine = None
        self.tokenizer = None
        self.stats = EngineStats()
        self.load_seconds: float | None = None
        self.inflight = 0
        self.sleeping = False
        self.pids: list[int] = []
        """vLLM's engine-core process(es) of this model: what the stall fault stops."""
        self.prometheus: set = set()
        """vLLM's own metric collectors of this engine (`vllm:*`, labelled by model_name)."""
        self.chat_template: str | None = None
        """The policy's `chat_template` as text (None: the tokenizer's own), loaded at start."""
        self.default_sampling: dict = {}
        """Sampling defaults of the model's generation config (vLLM's get_diff_sampling_param);
        a request's own values win, as in vLLM's server."""

    def start(self) -> None:
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase

        m = self.config
        t0 = time.monotonic()
        self.chat_template = load_chat_template(m)
        if m.generation_config not in ("auto", "vllm") and not Path(m.generation_config).is_dir():
            # vLLM would silently serve without the defaults; the policy asked for them.
            raise ConfigError(f"model {m.name}: generation_config: {m.generation_config!r} is not a folder (or auto, vllm)")
        args = AsyncEngineArgs(
            model=m.path,
            served_model_name=[m.name],
            tokenizer=m.path,
            max_model_len=m.max_model_len,
            kv_cache_memory_bytes=m.kv_cache_bytes,
            max_num_seqs=m.max_num_seqs,
            enable_prefix_caching=m.prefix_caching,
            dtype=m.dtype,
            enforce_eager=True,
            disable_log_stats=True,
            # vLLM's own span of each request, a child of the sidecar's (sidecar/tracing.py); None: off.
            otlp_traces_endpoint=tracing.vllm_endpoint(),
            scheduling_policy="priority" if self.priority_scheduling else "fcfs",
            generation_config=m.generation_config,
            # Also where vLLM's structured outputs learn where the reasoning ends (as `vllm serve`).
            reasoning_parser=m.reasoning_parser or "",
            structured_outputs_config=StructuredOutputsConfig(backend=m.structured_outputs_backend,
                                                              disable_any_whitespace=m.disable_any_whitespace),
        )
        sink = self.stats

        class Logger(_StatsLogger, StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                _StatsLogger.__init__(self, sink, vllm_config)

        from .metrics import vllm_collectors

        before, collectors = _child_pids(), vllm_collectors()
        self.engine = AsyncLLM.from_engine_args(args, stat_loggers=[Logger])
        self.pids = sorted(_child_pids() - before)
        self.prometheus = vllm_collectors() - collectors
        self.tokenizer = self.engine.get_tokenizer()
        self.default_sampling = dict(self.engine.model_config.get_diff_sampling_param())
        self.load_seconds = time.monotonic() - t0
        log.info("engine ready", extra={"model": m.name, "load_seconds": round(self.load_seconds, 2)})

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    # -- one generation ----------------------------------------------------------------------

    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        tok = self.tokenizer
        if req.messages is not None:
            try:
                text = tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False,
                                               chat_template=self.chat_template, **self.config.default_chat_template_kwargs)
            except Exception as e:  # a template error is the request's fault (bad roles, …)
                raise BadRequest(f"cannot render messages with the chat template: {e}", param="messages") from e
            return list(tok.encode(text, add_special_tokens=False))
        if req.prompt is None:
            raise BadRequest("a prompt is required", param="prompt")
        return list(tok.encode(req.prompt, add_special_tokens=True))

    def sampling_kwargs(self, req: GenerationRequest, prompt_len: int, default_max_tokens: int) -> dict:
        """vLLM's SamplingParams for `req` as keywords; a prompt too long for the model is the client's error."""
        max_model_len = self.config.max_model_len
        defaults = dict(self.default_sampling)
        # The generation config's max_new_tokens stands in for the server default, as in vLLM.
        default_max_tokens = min(default_max_tokens, defaults.pop("max_tokens", default_max_tokens))
        max_tokens = req.max_tokens or min(default_max_tokens, max_model_len - prompt_len)
        if max_tokens <= 0 or prompt_len + max_tokens > max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len + max(max_tokens, 0)} tokens ({prompt_len} in the messages, {max(max_tokens, 0)} in the completion).",
                param="max_tokens",
                code="context_length_exceeded",
            )
        kwargs: dict = defaults | {"max_tokens": max_tokens, "n": req.n, "ignore_eos": req.ignore_eos}
        if req.temperature is not None:
            kwargs["temperature"] = req.temperature
        if req.top_p is not None:
            kwargs["top_p"] = req.top_p
        if req.seed is not None:
            kwargs["seed"] = req.seed
        if req.stop:
            kwargs["stop"] = list(req.stop)
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "top_k", "min_p", "logprobs"):
            if (value := getattr(req, name)) is not None:
                kwargs[name] = value
        if req.min_tokens:
            kwargs["min_tokens"] = req.min_tokens
        if req.stop_token_ids:
            kwargs["stop_token_ids"] = list(req.stop_token_ids)
        if req.structured_output is not None:
            kwargs["structured_outputs"] = dict(req.structured_output)
        return kwargs

    def sampling_params(self, req: GenerationRequest, prompt_len: int, default_max_tokens: int):
        """vLLM's SamplingParams, checked as vLLM's engine checks them before it takes a request
        (SamplingParams.verify: logprobs limit, token ids in the vocabulary, the structured-output
        constraint compiled by its backend): a value vLLM refuses is a BadRequest naming it."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        kwargs = self.sampling_kwargs(req, prompt_len, default_max_tokens)
        constraint = kwargs.pop("structured_outputs", None)
        cfg = self.engine.vllm_config

        def verify(params) -> None:
            params.verify(self.engine.model_config, cfg.speculative_config, cfg.structured_outputs_config, self.tokenizer)

        try:
            params = SamplingParams(output_kind=RequestOutputKind.DELTA, **kwargs)
            verify(params)
        except (VLLMValidationError, ValueError, TypeError) as e:
            raise vllm_bad_request(e, set(kwargs)) from e
        if constraint is not None:
            # Checked on its own, so whatever vLLM says about it is reported as this field.
            try:
                params.structured_outputs = StructuredOutputsParams(**constraint)
                verify(params)
            except (VLLMValidationError, ValueError, TypeError) as e:
                raise vllm_bad_request(e, set(), param="structured_outputs") from e
        return params

    def _vllm_prompt(self, prompt_ids: list[int]):
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=prompt_ids)

    async def generate(self, req: GenerationRequest, prompt_ids: list[int], params, priority: int,
                       pause_s: Callable[[], float], trace_headers: dict[str, str] | None = None) -> AsyncIterator[TokenDelta | Completion]:
        """vLLM's outputs as TokenDeltas, then one Completion when vLLM finished the request
        (`trace_headers`: the request's trace context, while tracing is on, sidecar/tracing.py).

        After a step that produced tokens it waits `pause_s()` seconds (coalescing, see
        RequestLifecycle). A vLLM failure is raised as EngineFailed (vLLM has dropped the request)."""
        completion_tokens = 0
        finish: dict[int, str] = {}
        try:
            async for out in self.engine.generate(self._vllm_prompt(prompt_ids), params, req.request_id, priority=priority,
                                                  trace_headers=trace_headers):
                produced = False
                for o in out.outputs:
                    completion_tokens += len(o.token_ids)
                    if o.finish_reason:
                        finish[o.index] = o.finish_reason
                    if o.text or o.token_ids:
                        produced = True
                        yield TokenDelta(o.text, list(o.token_ids), o.index,
                                         token_logprobs(o.token_ids, o.logprobs, req.logprobs) if req.logprobs is not None else None)
                if out.finished:
                    yield Completion(finish.get(0, "stop"), len(prompt_ids), completion_tokens, self.config.name,
                                     finish_reasons={i: finish.get(i, "stop") for i in range(req.n)})
                    return
                if produced and (wait := pause_s()) > 0:
                    await asyncio.sleep(wait)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:
            if completion_tokens == 0 and _is_vllm_client_error(e):
                # vLLM refused the request itself (its input checks), before any output.
                raise vllm_bad_request(e, set()) from e
            log.exception("generation failed", extra={"request_id": req.request_id})
            raise EngineFailed(f"generation failed: {type(e).__name__}") from e

    async def abort(self, request_id: str) -> None:
        """Free a request's KV cache in vLLM now; harmless when vLLM no longer has it."""
        if self.engine is None:
            return
        try:
            await self.engine.abort(request_id)
            log.info("aborted request", extra={"request_id": request_id})
        except Exception:  # the engine may be shutting down; nothing is left to free
            log.debug("abort failed", exc_info=True)


def vllm_bad_request(e: BaseException, fields: set[str], param: str | None = None) -> BadRequest:
    """A request vLLM refused, as a BadRequest naming the field (vLLM's SamplingParams name)."""
    message = str(e.args[0]) if e.args else str(e)
    param = param or getattr(e, "parameter", None)
    if param is None:
        # Many of vLLM's checks name no parameter, but their message starts with it:
        # "min_p must be in [0, 1], got 1.5."
        first = re.match(r"\w+", message)
        param = first.group(0) if first and first.group(0) in fields else None
    return BadRequest(message, param=param)


def _is_vllm_client_error(e: BaseException) -> bool:
    from vllm.exceptions import VLLMClientError

    return isinstance(e, VLLMClientError)


def token_logprobs(token_ids, logprobs, top_n: int) -> list[TokenLogprob]:
    """vLLM's per-position logprob maps (token id -> Logprob) as TokenLogprobs for the tokens
    generated, each with the `top_n` most likely tokens of its position (by vLLM's rank)."""
    out = []
    for token_id, position in zip(token_ids, logprobs or ()):
        if position is None or (chosen := position.get(token_id)) is None:
            continue
        ranked = sorted(((lp.rank, tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= top_n),
                        key=lambda r: r[0])
        out.append(TokenLogprob(token_id, chosen.decoded_token or "", chosen.logprob, chosen.rank or 0,
                                [(tid, lp.decoded_token or "", lp.logprob) for _, tid, lp in ranked]))
    return out


def load_chat_template(m: ModelConfig) -> str | None:
    """The model's `chat_template` as Jinja text, read as vLLM's server reads `--chat-template`
    (a path, a bundled template's name or the text itself); a missing file fails the start."""
    if m.chat_template is None:
        return None
    from vllm.exceptions import VLLMValidationError
    from vllm.renderers.chat_utils import load_chat_template as vllm_load
    from vllm.renderers.chat_utils import validate_chat_template

    try:
        validate_chat_template(m.chat_template)
        return vllm_load(m.chat_template)
    except (OSError, ValueError, VLLMValidationError) as e:
        raise ConfigError(f"model {m.name}: chat_template: {e}") from e


def _gpu_present() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


class Ladder:
    """The pool's models, primary first, lighter fallbacks after it."""

    def __init__(self, models: list[ModelConfig], priority_scheduling: bool = False, make_engine: type[ModelEngine] = ModelEngine):
        self.engines = [make_engine(m, priority_scheduling) for m in models]
        self.primary = self.engines[0]
        self.gpu = False
        """Decided at start: vLLM's sleep mode needs CUDA."""

    def __iter__(self) -> Iterator[ModelEngine]:
        return iter(self.engines)

    def __len__(self) -> int:
        return len(self.engines)

    def __getitem__(self, i: int) -> ModelEngine:
        return self.engines[i]

    def start(self, standby: bool) -> None:
        """Load the primary model and, with `standby`, the next one (blocking: tens of seconds on CPU)."""
        self.gpu = _gpu_present()
        self.primary.start()
        if standby and len(self.engines) > 1:
            self.engines[1].start()

    def shutdown(self) -> None:
        for m in self.engines:
            m.shutdown()

    def serving(self, degrade: bool) -> ModelEngine:
        """The model new requests for the primary get: the next loaded one while degraded."""
        if degrade:
            for m in self.engines[1:]:
                if m.engine is not None:
                    return m
        return self.primary

    def resolve(self, name: str | None) -> ModelEngine:
        """The model a request names (by name or alias); none named is the primary."""
        if not name:
            return self.primary
        for m in self.engines:
            if name == m.config.name or name in m.config.aliases:
                return m
        raise UnknownModel(name, [n for m in self.engines for n in (m.config.name, *m.config.aliases)])

    async def apply_sleep_mode(self, degraded: bool) -> None:
        """On a GPU, a degraded pool puts the primary to sleep once its in-flight requests are done,
        so its memory is really freed, and wakes it when the pool recovers. Off on CPU."""
        primary = self.primary
        if not self.gpu or len(self.engines) < 2 or primary.engine is None:
            return
        if degraded and not primary.sleeping and primary.inflight == 0:
            await primary.engine.sleep(level=1)
            primary.sleeping = True
            log.warning("primary model asleep", extra={"model": primary.config.name})
        elif not degraded and primary.sleeping:
            await primary.engine.wake_up()
            primary.sleeping = False
            log.warning("primary model awake", extra={"model": primary.config.name})
