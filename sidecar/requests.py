"""What both fronts ask of the pool and what a generation streams back, front-neutral."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import BadRequest


@dataclass
class GenerationRequest:
    """One request as a front parsed it (OpenAI JSON or the gRPC message)."""

    model: str | None
    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    """None: no log probabilities; N: each generated token's and the N most likely at each position."""
    structured_output: dict | None = None
    """vLLM's StructuredOutputsParams as keywords: exactly one of `json` (a schema), `regex`, `choice`."""
    request_id: str = ""
    """Empty: admission assigns one."""
    request_class: str = ""
    """As the mesh sent it (`x-infermesh-class`); admission maps unknown ones to the default class."""
    ttft_give_up_s: float | None = None
    """No first token this long after admission: the request ends with DeadlineExceeded (the
    mesh's `x-infermesh-ttft-give-up-ms`, set on the routes of a hedging class)."""


TTFT_GIVE_UP_HEADER = "x-infermesh-ttft-give-up-ms"


def ttft_give_up_s(value: str | None) -> float | None:
    """The header's value in seconds; None when absent or not a positive integer (the mesh sets
    it, so a bad value is ignored rather than refused)."""
    n = decimal(value)
    return None if not n else n / 1000.0


def decimal(value: str | None, max_digits: int = 18) -> int | None:
    """`value` as a non-negative decimal integer, or None: ASCII digits only (`str.isdigit()` also
    takes '²', which int() then refuses) and at most `max_digits` of them (int() refuses > 4300)."""
    if value is None or not value or len(value) > max_digits or not (value.isascii() and value.isdigit()):
        return None
    return int(value)


@dataclass
class TokenDelta:
    """New text of one choice."""

    text: str
    token_ids: list[int]
    index: int = 0
    """Which of the `n` choices these tokens belong to."""
    logprobs: list[TokenLogprob] | None = None
    """One per token of `token_ids` when the request asked for log probabilities."""


@dataclass
class TokenLogprob:
    """A generated token's log probability and the most likely tokens at its position."""

    token_id: int
    token: str
    logprob: float
    rank: int
    top: list[tuple[int, str, float]] = field(default_factory=list)
    """(token id, text, log probability), most likely first."""


@dataclass
class Completion:
    """The last event of every stream."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    model: str
    degraded: bool = False
    degraded_reason: str = ""
    finish_reasons: dict[int, str] = field(default_factory=dict)
    """Per choice index (n > 1); `finish_reason` is choice 0's."""


# -- JSON bodies -----------------------------------------------------------------------------------

MAX_JSON_DEPTH = 128
"""Deepest nesting of arrays and objects a body may have. Python's parser, pydantic and the
template and grammar code behind them recurse on nesting: ~1 KB of `[` reached a RecursionError
(a plain-text 500). 128 leaves room for any real JSON schema or tool definition."""

_SURROGATE = re.compile(rb"\\[uU][dD][89a-fA-F]|\xed[\xa0-\xbf]")
"""Where a lone UTF-16 surrogate can come from: a `\\uD800`-`\\uDFFF` escape, or raw surrogate
bytes (json.loads decodes bytes with 'surrogatepass'). Paired escapes match too; they are checked."""


def _non_standard(name: str):
    raise ValueError(f"{name} is not valid JSON")


def json_body(body: bytes | str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`body` parsed as strict JSON, or BadRequest naming where it went wrong: not JSON (NaN and
    Infinity included), nested deeper than `max_depth`, or a string with a lone UTF-16 surrogate
    (which no UTF-8 encoder, tokenizer or response writer downstream accepts)."""
    try:
        data = json.loads(body, parse_constant=_non_standard)
    except RecursionError:
        raise BadRequest(f"the body is nested more than {max_depth} levels deep", param="body", code="too_deep") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}", param="body", code="json_invalid") from None
    raw = body if isinstance(body, bytes) else body.encode("utf-8", "surrogatepass")
    # Nesting is bounded by the number of brackets: most bodies need no walk at all.
    if raw.count(b"[") + raw.count(b"{") > max_depth and (where := _too_deep(data, max_depth)) is not None:
        raise BadRequest(f"`{where}` is nested more than {max_depth} levels deep", param=where, code="too_deep")
    if _SURROGATE.search(raw):
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            where = _surrogate_at(data)
            raise BadRequest(f"`{where}` holds a lone UTF-16 surrogate, which is not text", param=where,
                             code="invalid_unicode") from None
    return data


def _path(parts: tuple) -> str:
    """`body.a.0.b`; a key that is not text (a lone surrogate) shown escaped, so the answer can be written."""
    return ".".join(["body", *(str(p).encode("utf-8", "backslashreplace").decode() for p in parts)])


def _too_deep(data: Any, max_depth: int) -> str | None:
    """The path of the first container deeper than `max_depth`, or None (iterative: no recursion)."""
    stack = [(data, 1, ())]
    while stack:
        node, depth, parts = stack.pop()
        if depth > max_depth:
            return _path(parts)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        stack.extend((v, depth + 1, (*parts, k)) for k, v in items if isinstance(v, (dict, list)))
    return None


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _surrogate_at(data: Any) -> str:
    """The path of the first string (value or key) with a lone surrogate."""
    stack = [(data, ())]
    while stack:
        node, parts = stack.pop()
        if isinstance(node, str):
            if _has_surrogate(node):
                return _path(parts)
        elif isinstance(node, dict):
            for k, v in node.items():
                if _has_surrogate(k):
                    return _path((*parts, k))
                stack.append((v, (*parts, k)))
        elif isinstance(node, list):
            stack.extend((v, (*parts, i)) for i, v in enumerate(node))
    return "body"
