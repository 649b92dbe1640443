"""Errors the fronts turn into HTTP (OpenAI error JSON) and gRPC status codes.

Each error says whether a retry can succeed (`retryable`), so clients and the mesh can tell a
shed request from a bad one.
"""

from __future__ import annotations

import grpc


class SidecarError(Exception):
    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL
    openai_type = "server_error"
    retryable = False

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.openai_type, "param": self.param, "code": self.code}}


class BadRequest(SidecarError):
    http_status = 400
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    openai_type = "invalid_request_error"


class PayloadTooLarge(BadRequest):
    http_status = 413


class UnknownModel(SidecarError):
    http_status = 404
    grpc_code = grpc.StatusCode.NOT_FOUND
    openai_type = "invalid_request_error"

    def __init__(self, model: str, known: list[str]):
        self.model, self.known = model, known
        super().__init__(
            f"The model `{model}` does not exist on this pool. Available: {', '.join(known)}",
            param="model",
            code="model_not_found",
        )


class DuplicateRequest(SidecarError):
    http_status = 409
    grpc_code = grpc.StatusCode.ALREADY_EXISTS
    openai_type = "invalid_request_error"


class Overloaded(SidecarError):
    """Shed: more requests than the configured limit, or the pool is protecting itself."""

    http_status = 429
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    openai_type = "rate_limit_error"
    retryable = True


class Unavailable(SidecarError):
    """The engine is not ready, or the sidecar is draining."""

    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE
    openai_type = "server_error"
    retryable = True


class EngineFailed(SidecarError):
    """vLLM failed while generating; the request is lost but the engine may still serve."""

    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL


class DeadlineExceeded(SidecarError):
    """No first token within the mesh's time-to-first-token limit; vLLM's request is aborted."""

    http_status = 504
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    openai_type = "server_error"
    retryable = True
