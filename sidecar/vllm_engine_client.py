"""The EngineClient that vLLM's own serving layer (OpenAIServingChat, …) calls, for one model of
the ladder: a thin proxy over that model's AsyncLLM whose `generate` is where infermesh sits.

vLLM's layer renders the prompt (chat template, tools, multimodal parts), builds SamplingParams
(structured outputs, logprobs, penalties, the model's generation config) and formats the answer;
the request it generates for was admitted by the front before (see http_api.py), and `generate`
runs it through that request's lifecycle: the class's vLLM priority in place of the client's,
coalesced streaming, TTFT / inter-token / token metrics, the error window, abort on release.
Everything else (model_config, renderer, input_processor, errored, …) is the AsyncLLM's own.

Written here rather than reused: vLLM has no hook between its serving layer and its engine; an
EngineClient proxy is the seam its API offers (tests/test_vllm_serving_contract.py pins it).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from .errors import SidecarError

if TYPE_CHECKING:
    from .engines import ModelEngine
    from .lifecycle import RequestLifecycle
    from .pool import Pool

ADMITTED: ContextVar["RequestLifecycle"] = ContextVar("infermesh_admitted_request")
"""The request the front admitted, set before it calls vLLM's layer. vLLM's layer calls
`generate` from within that call (or, for a stream, from the response's task, which copies the
context), so each generation finds its own request, whatever ids vLLM gave it."""


class Attempt:
    """How far vLLM's layer got with one request. An exception before it called the engine came
    from preparing the request (templates, sampling parameters, the renderer: the client's
    input); one after it, from the engine or the answer's formatting."""

    def __init__(self):
        self.engine_called = False


ATTEMPT: ContextVar[Attempt] = ContextVar("infermesh_attempt")
"""The front's Attempt for the request it hands vLLM's layer (a shared object: a task copies the
context, so the marks made inside it are seen outside)."""


class NotAdmitted(SidecarError):
    """A generation vLLM's layer started for a request the front did not admit: a bug."""


class MeshEngineClient:
    """vLLM's EngineClient for one ModelEngine of the pool."""

    def __init__(self, engine: "ModelEngine"):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        # model_config, vllm_config, renderer, input_processor, errored, dead_error, …
        return getattr(self._engine.engine, name)

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """Admission ran before vLLM's layer saw the request (so a refusal has its own status)."""

    def generate(self, prompt, sampling_params, request_id: str, **kwargs):
        life = ADMITTED.get(None)
        if life is None or life.admission is None or life.admission.engine is not self._engine:
            raise NotAdmitted(f"vLLM request {request_id!r} was not admitted to {self._engine.config.name}")
        kwargs.pop("priority", None)  # the class's, set by the lifecycle
        outputs = life.vllm_outputs(prompt, sampling_params, request_id, **kwargs)
        if (attempt := ATTEMPT.get(None)) is not None:
            attempt.engine_called = True
        return outputs

    async def abort(self, request_id) -> None:
        await self._engine.abort(request_id)

