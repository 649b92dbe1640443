"""Per-model serving settings of the policy (chat template, tool-call and reasoning parsers, chat
template kwargs, generation config, structured-output backend and compact JSON): checked like every other field (file, line, field), parser
names against vLLM's own registries, and carried unchanged into each pool's sidecar config."""

from __future__ import annotations

import pytest

from infermesh.meshconfig.policy import LOCAL_POLICY, PolicyError, parse_policy
from infermesh.settings import vllm_parser_names
from infermesh.sidecar.config import SidecarConfig

GOOD = LOCAL_POLICY.read_text()
SMALL = "      - {name: tiny-llama-small}\n"
assert SMALL in GOOD


def with_model(fields: str) -> str:
    """The local policy with the interactive pool's fallback model given these YAML fields."""
    return GOOD.replace(SMALL, "      - name: tiny-llama-small\n" + "".join(f"        {ln}\n" for ln in fields.strip().splitlines()))


def problems(text: str) -> list[tuple[int | None, str, str]]:
    with pytest.raises(PolicyError) as e:
        parse_policy(text, "p.yaml")
    return e.value.problems


def line_of(text: str, needle: str) -> int:
    return next(i for i, ln in enumerate(text.splitlines(), 1) if needle in ln)


FIELD = "pools.interactive.models.1."

SETTINGS = """
chat_template: "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
tool_call_parser: hermes
enable_auto_tool_choice: true
reasoning_parser: deepseek_r1
default_chat_template_kwargs: {enable_thinking: false, persona: {name: ada}}
generation_config: vllm
structured_outputs_backend: guidance
disable_any_whitespace: true
"""


def test_the_settings_are_read_and_reach_the_sidecar_config(tmp_path):
    policy = parse_policy(with_model(SETTINGS), "p.yaml")
    m = policy.pools["interactive"].models[1]
    assert m.chat_template.startswith("{% for m in messages %}")
    assert (m.tool_call_parser, m.enable_auto_tool_choice, m.reasoning_parser) == ("hermes", True, "deepseek_r1")
    assert m.default_chat_template_kwargs == {"enable_thinking": False, "persona": {"name": "ada"}}
    assert m.generation_config == "vllm"
    assert (m.structured_outputs_backend, m.disable_any_whitespace) == ("guidance", True)
    cfg = SidecarConfig.model_validate(policy.sidecar_config("interactive", tmp_path)).models[1]
    assert cfg.model_dump(exclude={"path"}) == m.model_dump(exclude={"path"})


def test_defaults_are_vllms():
    m = parse_policy(GOOD, "p.yaml").pools["interactive"].models[1]
    assert (m.chat_template, m.tool_call_parser, m.enable_auto_tool_choice, m.reasoning_parser) == (None, None, False, None)
    assert m.default_chat_template_kwargs == {} and m.generation_config == "auto"
    assert (m.structured_outputs_backend, m.disable_any_whitespace) == ("auto", False)


def test_a_path_or_a_bundled_template_name_is_left_to_the_sidecar():
    """Only the sidecar's machine can open a path; text without Jinja characters is one (vLLM's rule)."""
    for value in ("/etc/templates/llama3.jinja", "template_chatml.jinja"):
        assert parse_policy(with_model(f"chat_template: {value}"), "p.yaml").pools["interactive"].models[1].chat_template == value


@pytest.mark.parametrize("fields, field, message", [
    ('chat_template: "{% for m in messages %}{{ m.content }"', "chat_template", "not a valid Jinja template (line 1 of the template)"),
    ('chat_template: "{% if x %}\\nhello"', "chat_template", "not a valid Jinja template"),
    ('chat_template: ""', "chat_template", "at least 1 character"),
    ("tool_call_parser: hermes2", "tool_call_parser", "'hermes2' is not one of vLLM's tool-call parsers: "),
    ("reasoning_parser: deepseek", "reasoning_parser", "'deepseek' is not one of vLLM's reasoning parsers: "),
    ("enable_auto_tool_choice: true", "enable_auto_tool_choice", "enable_auto_tool_choice requires tool_call_parser"),
    ("enable_auto_tool_choice: maybe", "enable_auto_tool_choice", "valid boolean"),
    ("default_chat_template_kwargs: [enable_thinking]", "default_chat_template_kwargs", "valid dictionary"),
    ("generation_config: ''", "generation_config", "at least 1 character"),
    ("tool_parser: hermes", "tool_parser", "Extra inputs are not permitted"),
    ("structured_outputs_backend: outline", "structured_outputs_backend", "'auto', 'xgrammar', 'guidance', 'outlines' or 'lm-format-enforcer'"),
    ("disable_any_whitespace: true", "disable_any_whitespace", "requires structured_outputs_backend xgrammar or guidance"),
    ("structured_outputs_backend: outlines\ndisable_any_whitespace: true", "disable_any_whitespace", "not 'outlines'"),
    ("disable_any_whitespace: sometimes", "disable_any_whitespace", "valid boolean"),
])
def test_a_bad_setting_is_refused_by_file_line_and_field(fields, field, message):
    text = with_model(fields)
    (line, got_field, msg), = problems(text)
    assert (got_field, line) == (FIELD + field, line_of(text, field + ":"))
    assert message in msg


def test_parser_names_are_vllms_registries():
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    assert vllm_parser_names("tool") == tuple(ToolParserManager.list_registered())
    assert vllm_parser_names("reasoning") == tuple(ReasoningParserManager.list_registered())
    assert {"hermes", "llama3_json", "pythonic"} <= set(vllm_parser_names("tool"))
    assert {"deepseek_r1", "qwen3"} <= set(vllm_parser_names("reasoning"))


def test_structured_output_settings_are_vllms():
    """The backends vLLM accepts, and its own refusal of compact JSON on a backend without it."""
    import typing

    from vllm.config import StructuredOutputsConfig
    from vllm.config.structured_outputs import StructuredOutputsBackend as Vllm

    from infermesh.settings import COMPACT_JSON_BACKENDS, StructuredOutputsBackend

    assert typing.get_args(StructuredOutputsBackend) == typing.get_args(Vllm)
    for backend in typing.get_args(Vllm):
        if backend in COMPACT_JSON_BACKENDS:
            StructuredOutputsConfig(backend=backend, disable_any_whitespace=True)
        else:
            with pytest.raises(ValueError, match="disable_any_whitespace"):
                StructuredOutputsConfig(backend=backend, disable_any_whitespace=True)
