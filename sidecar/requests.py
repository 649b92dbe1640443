"""What both fronts ask of the pool and what a generation streams back, front-neutral."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    if value is None or not value.isdigit() or int(value) == 0:
        return None
    return int(value) / 1000.0


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
