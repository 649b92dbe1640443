"""A model's serving settings from the policy reach vLLM: generation_config and reasoning_parser
as engine args, the chat template and its default kwargs in every chat render, the generation
config's sampling defaults under a request's own values. vLLM's engine is replaced by a capturing
fake (FakeEngineArgs / FakeAsyncLLMFactory); vLLM's template loader is the real one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from infermesh.sidecar.config import ConfigError, ModelConfig
from infermesh.sidecar.engines import ModelEngine, load_chat_template
from infermesh.sidecar.errors import BadRequest
from infermesh.sidecar.requests import GenerationRequest

TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"


def model(**fields) -> ModelConfig:
    return ModelConfig(name="m", path="/models/m", **fields)


class FakeTemplateTokenizer:
    """Records what each chat render is given besides the messages."""

    def __init__(self):
        self.template_calls: list[dict] = []

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool, chat_template=None, **kwargs) -> str:
        self.template_calls.append({"chat_template": chat_template, **kwargs})
        return "".join(m["content"] for m in messages)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


class FakeEngineArgs:
    """Records the keywords ModelEngine.start gives vLLM's AsyncEngineArgs."""

    seen: dict = {}

    def __init__(self, **kwargs):
        FakeEngineArgs.seen = kwargs


class FakeAsyncLLMFactory:
    """AsyncLLM.from_engine_args stand-in: an engine whose model config has these defaults."""

    defaults: dict = {}

    @classmethod
    def from_engine_args(cls, args, stat_loggers=()):
        return SimpleNamespace(get_tokenizer=FakeTemplateTokenizer,
                               model_config=SimpleNamespace(get_diff_sampling_param=lambda: dict(cls.defaults)))


@pytest.fixture
def started(monkeypatch):
    """started(config, defaults={}) -> a ModelEngine started on the capturing fakes."""
    import vllm.engine.arg_utils
    import vllm.v1.engine.async_llm

    monkeypatch.setattr(vllm.engine.arg_utils, "AsyncEngineArgs", FakeEngineArgs)
    monkeypatch.setattr(vllm.v1.engine.async_llm, "AsyncLLM", FakeAsyncLLMFactory)

    def start(config: ModelConfig, defaults: dict | None = None) -> ModelEngine:
        FakeAsyncLLMFactory.defaults = defaults or {}
        e = ModelEngine(config)
        e.start()
        return e

    return start


def test_engine_args_carry_generation_config_and_reasoning_parser(started, tmp_path):
    started(model(generation_config="vllm", reasoning_parser="deepseek_r1"))
    assert (FakeEngineArgs.seen["generation_config"], FakeEngineArgs.seen["reasoning_parser"]) == ("vllm", "deepseek_r1")
    started(model())
    assert (FakeEngineArgs.seen["generation_config"], FakeEngineArgs.seen["reasoning_parser"]) == ("auto", "")
    started(model(generation_config=str(tmp_path)))
    assert FakeEngineArgs.seen["generation_config"] == str(tmp_path)


def test_engine_args_set_prefix_caching_explicitly(started):
    started(model())
    assert FakeEngineArgs.seen["enable_prefix_caching"] is True, "on by default, never left to vLLM's default"
    started(model(prefix_caching=False))
    assert FakeEngineArgs.seen["enable_prefix_caching"] is False


def test_a_generation_config_folder_that_is_missing_fails_the_start(started, tmp_path):
    with pytest.raises(ConfigError, match=r"model m: generation_config: '.*nowhere' is not a folder"):
        started(model(generation_config=str(tmp_path / "nowhere")))


def test_chat_renders_use_the_policys_template_and_kwargs(started, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    e = started(model(chat_template=str(path), default_chat_template_kwargs={"enable_thinking": False}))
    e.prompt_ids(GenerationRequest(model=None, messages=[{"role": "user", "content": "hi"}]))
    assert e.tokenizer.template_calls == [{"chat_template": TEMPLATE, "enable_thinking": False}]


def test_no_template_set_is_the_tokenizers_own(make_pool):
    e = make_pool({"pool": "p", "models": [model().model_dump()]}).primary
    e.prompt_ids(GenerationRequest(model=None, messages=[{"role": "user", "content": "hi"}]))
    assert e.tokenizer.template_calls == [{"chat_template": None}]


def test_templates_load_as_vllms_server_loads_them(tmp_path):
    assert load_chat_template(model(chat_template=TEMPLATE)) == TEMPLATE
    assert "im_start" in load_chat_template(model(chat_template="template_chatml.jinja"))  # bundled with vLLM
    assert load_chat_template(model()) is None
    with pytest.raises(ConfigError, match=r"model m: chat_template: .*appears path-like, but doesn't exist"):
        load_chat_template(model(chat_template=str(tmp_path / "missing.jinja")))


def test_generation_config_defaults_sit_under_the_requests_own_values(make_pool):
    e = make_pool({"pool": "p", "models": [model(max_model_len=100).model_dump()]}).primary
    e.default_sampling = {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 30}
    kw = e.sampling_kwargs(GenerationRequest(model=None, temperature=0.0), prompt_len=10, default_max_tokens=64)
    assert (kw["temperature"], kw["top_k"], kw["repetition_penalty"]) == (0.0, 20, 1.1)
    assert kw["max_tokens"] == 30, "max_new_tokens of the generation config stands in for the server default"
    assert e.sampling_kwargs(GenerationRequest(model=None, max_tokens=50), 10, 64)["max_tokens"] == 50
    assert e.sampling_kwargs(GenerationRequest(model=None), 80, 64)["max_tokens"] == 20, "capped by the context"
    with pytest.raises(BadRequest):
        e.sampling_kwargs(GenerationRequest(model=None, max_tokens=95), 10, 64)
