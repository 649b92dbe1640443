"""Mutation fuzz inputs for infermesh's HTTP fronts: ordinary OpenAI / Anthropic request bodies,
the state endpoint's query strings and the admin API's fault bodies, each mutated the ways the
hardening issue (28) found to break a front: values of the wrong type (nested ones too), lone
UTF-16 surrogates, deep nesting, truncation, huge numbers, bytes that are not UTF-8.

Deterministic for a seed (`random.Random(seed)`), so a failing case is replayed by its seed and
index. Used by the sidecar's own fuzz tests (sidecar/tests/test_fuzz_http_fronts.py) and meant
for the through-Envoy fuzz as well: every case is a plain (method, path, body bytes, headers).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Iterator

JSON = {"content-type": "application/json"}


@dataclass
class Case:
    """One request to send."""

    method: str
    path: str
    body: bytes | None
    kind: str
    """Which mutation made it (for a failure's message)."""
    headers: dict = field(default_factory=lambda: dict(JSON))

    def describe(self) -> str:
        body = (self.body or b"")[:160]
        return f"{self.kind}: {self.method} {self.path} {body!r}{'…' if self.body and len(self.body) > 160 else ''}"


def check_answer(r: Any, case: Case) -> None:
    """What every fuzzed answer must be (an httpx or Starlette test-client response): no 5xx, an
    error as JSON with a message, no error event with a 5xx code inside a stream."""
    what = case.describe()
    assert r.status_code < 500, f"{r.status_code} {r.text[:300]} <- {what}"
    ctype = r.headers.get("content-type", "")
    if r.status_code >= 400:
        assert ctype.startswith("application/json"), f"{r.status_code} not JSON ({ctype}): {r.text[:200]} <- {what}"
        err = r.json().get("error")
        assert isinstance(err, dict) and err.get("message"), f"no error message: {r.text[:200]} <- {what}"
    elif ctype.startswith("text/event-stream"):
        for line in r.text.splitlines():
            if line.startswith("data: {") and '"error"' in line[:20]:
                code = json.loads(line[6:])["error"].get("code")
                assert not (isinstance(code, int) and code >= 500), f"in-stream {line[:200]} <- {what}"


def seed_bodies(model: str = "m") -> list[tuple[str, dict]]:
    """Ordinary requests of each API (the starting points of the mutations)."""
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    return [
        ("/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 4}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                  "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "seed": 1,
                                  "stop": ["\n"], "logprobs": True, "top_logprobs": 2, "n": 1,
                                  "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}),
        ("/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 4,
                                  "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}],
                                  "tool_choice": "none"}),
        ("/v1/completions", {"model": model, "prompt": "say", "max_tokens": 4}),
        ("/v1/completions", {"model": model, "prompt": ["a", "b"], "max_tokens": 2, "stream": True, "echo": False, "logprobs": 1}),
        ("/v1/completions", {"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "structured_outputs": {"choice": ["a", "b"]}}),
        ("/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 4}),
        ("/v1/messages", {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
        ("/tokenize", {"model": model, "prompt": "Hello world"}),
        ("/tokenize", {"model": model, "messages": msgs}),
        ("/detokenize", {"model": model, "tokens": [1, 2, 3]}),
    ]


EXTRA_FIELDS = ["structured_outputs", "response_format", "tools", "tool_choice", "logit_bias", "stop", "stream_options",
                "chat_template_kwargs", "chat_template", "logprobs", "top_logprobs", "n", "seed", "max_tokens",
                "max_completion_tokens", "prompt_logprobs", "priority", "request_id", "messages", "prompt", "model",
                "temperature", "top_k", "min_p", "repetition_penalty", "truncate_prompt_tokens", "allowed_token_ids",
                "bad_words", "vllm_xargs", "mm_processor_kwargs", "add_special_tokens", "documents", "echo",
                "continue_final_message", "add_generation_prompt", "include_stop_str_in_output", "return_tokens_as_token_ids",
                "parallel_tool_calls", "reasoning_effort", "user", "metadata", "input", "instructions", "text", "tokens",
                "kv_transfer_params", "cache_salt", "thinking", "system", "stop_sequences", "min_tokens", "stream"]

_RAW = "\x00raw{}\x00"
"""A placeholder for text that is not a JSON value of its own (spliced in after dumping)."""


class Mutator:
    """Mutations of JSON bodies for one seed."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self._raw: list[str] = []

    # -- values --------------------------------------------------------------------------------

    def odd_value(self, depth: int = 0) -> Any:
        r = self.rng
        choices = [
            lambda: r.choice([0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**30]),
            lambda: r.choice([0.5, -0.0, 1e308, -1e308, 1e-320]),
            lambda: r.choice(["", "x", "\ud800", "a\udfffb", "\x00", "null", "1", "{}", "😀", "x" * 2000]),
            lambda: None,
            lambda: r.choice([True, False]),
            lambda: [] if depth > 1 else [self.odd_value(depth + 1) for _ in range(r.randint(0, 3))],
            lambda: {} if depth > 1 else {r.choice(["type", "json", "a", "\ud800", ""]): self.odd_value(depth + 1)},
            lambda: self.raw(r.choice(["1e400", "-1e400", "9" * 5000, "0.0000e-99999", "[" * 600 + "]" * 600,
                                       "{\"a\":" * 300 + "1" + "}" * 300, "NaN", "Infinity"])),
        ]
        return r.choice(choices)()

    def raw(self, text: str) -> str:
        self._raw.append(text)
        return _RAW.format(len(self._raw) - 1)

    def dumps(self, value: Any) -> bytes:
        # ensure_ascii writes a lone surrogate as its \\uXXXX escape, as a client's JSON encoder does.
        text = json.dumps(value, ensure_ascii=True)
        for i, raw in enumerate(self._raw):
            text = text.replace(json.dumps(_RAW.format(i)), raw)
        self._raw.clear()
        return text.encode()

    # -- structure -----------------------------------------------------------------------------

    @staticmethod
    def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
        out = [prefix]
        if isinstance(value, dict):
            for k, v in value.items():
                out += Mutator._paths(v, (*prefix, k))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                out += Mutator._paths(v, (*prefix, i))
        return out

    @staticmethod
    def _set(value: Any, path: tuple, new: Any) -> Any:
        if not path:
            return new
        value = json.loads(json.dumps(value))  # a copy
        node = value
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = new
        return value

    def mutate(self, body: dict) -> tuple[str, bytes]:
        """One mutation of `body`: (its kind, the bytes to send)."""
        r = self.rng
        kind = r.choice(["swap", "swap", "swap", "field", "field", "surrogate", "deep", "truncate", "bytes", "drop"])
        if kind == "swap":  # any node, nested ones included, replaced by a value of another type
            path = r.choice(self._paths(body)[1:] or [()])
            return f"swap {'.'.join(map(str, path))}", self.dumps(self._set(body, path, self.odd_value()))
        if kind == "field":  # a field the API knows (or another API's) with an odd value
            name = r.choice(EXTRA_FIELDS)
            return f"field {name}", self.dumps(dict(body, **{name: self.odd_value()}))
        if kind == "surrogate":  # a lone surrogate in some string, or in a key
            strings = [p for p in self._paths(body) if p and isinstance(self._get(body, p), str)]
            if strings and r.random() < 0.8:
                path = r.choice(strings)
                return f"surrogate {'.'.join(map(str, path))}", self.dumps(self._set(body, path, self._get(body, path) + r.choice(["\ud800", "\udc00", "\udbff"])))
            return "surrogate key", self.dumps(dict(body, **{"\ud800": 1}))
        if kind == "deep":  # ~1 KB and more of nested brackets in place of a value
            path = r.choice(self._paths(body)[1:] or [()])
            n = r.choice([130, 600, 1024, 5000])
            nest = r.choice(["[" * n + "]" * n, '{"a":' * n + "1" + "}" * n, "[" * n])
            return f"deep {n} at {'.'.join(map(str, path))}", self.dumps(self._set(body, path, self.raw(nest)))
        if kind == "truncate":
            data = self.dumps(body)
            return "truncate", data[: r.randint(0, max(0, len(data) - 1))]
        if kind == "bytes":  # not UTF-8, NULs, a BOM, raw surrogate bytes (json's 'surrogatepass' takes them)
            data = self.dumps(body)
            junk = r.choice([b"\xff\xfe", b"\x00", b"\xef\xbb\xbf", b"\xed\xa0\x80", b"\xc3", b"\x80"])
            at = r.randint(0, len(data))
            return "bytes", data[:at] + junk + data[at:]
        # drop: a required part missing, or the whole body a scalar
        if r.random() < 0.5 and body:
            key = r.choice(list(body))
            return f"drop {key}", self.dumps({k: v for k, v in body.items() if k != key})
        return "scalar body", r.choice([b"", b"null", b"[]", b"5", b'"x"', b"{}", b"{" * 10])

    @staticmethod
    def _get(value: Any, path: tuple) -> Any:
        for p in path:
            value = value[p]
        return value


def api_cases(seed: int, n: int, model: str = "m") -> Iterator[Case]:
    """`n` mutated requests over every API of the OpenAI front (and tokenize/detokenize)."""
    m = Mutator(seed)
    seeds = seed_bodies(model)
    for _ in range(n):
        path, body = m.rng.choice(seeds)
        kind, data = m.mutate(body)
        headers = dict(JSON)
        if m.rng.random() < 0.05:
            headers["content-type"] = m.rng.choice(["text/plain", "application/json; charset=latin-1", "", "application/x-www-form-urlencoded"])
        yield Case("POST", path, data, kind, headers)


STATE_QUERIES = ["", "?healthy_below=1", "?healthy_below=4", "?healthy_below=%C2%B2", "?healthy_below=%EF%BC%93",  # '²', fullwidth 3
                 "?healthy_below=" + "9" * 5000, "?healthy_below=-1", "?healthy_below=1.5", "?healthy_below=%00",
                 "?healthy_below=%ED%A0%80", "?healthy_below=%FF", "?healthy_below", "?healthy_below=1&healthy_below=x",
                 "?%FF=1", "?a=%", "?healthy_below=+1", "?healthy_below=0x1", "?healthy_below=%D9%A3"]  # Arabic-Indic 3


def state_cases(seed: int, n: int) -> Iterator[Case]:
    """GET /infermesh/state with odd query strings (the ones known to have broken it first)."""
    rng = random.Random(seed)
    for i in range(n):
        if i < len(STATE_QUERIES):
            q = STATE_QUERIES[i]
        else:
            q = "?healthy_below=" + "".join(rng.choice(["1", "²", "%C2%B2", "%", "%FF", "-", "3", "٣", " ", "+", "e"]) for _ in range(rng.randint(0, 6)))
        yield Case("GET", "/infermesh/state" + q, None, "state query", {})


def admin_cases(seed: int, n: int, signals: list[str]) -> Iterator[Case]:
    """PUT /admin/faults/{signal} with mutated bodies (and odd signal names)."""
    m = Mutator(seed)
    seeds = [{"value": 0.5, "duration_s": 5}, {"value": 0.5, "duration_s": 5, "period_s": 1}]
    for _ in range(n):
        signal = m.rng.choice(signals + ["stall", "x", "%ED%A0%80", "%FF", "..", "a" * 300])
        kind, data = m.mutate(m.rng.choice(seeds))
        yield Case("PUT", f"/admin/faults/{signal}", data, f"admin {kind}")
