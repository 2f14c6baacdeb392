"""What a batch job writes: one entry per request, in input order."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from batch_pipeline.contract.base import WireModel


class TokenOutput(WireModel):
    token: str
    log_prob: float


class CompletionOutput(WireModel):
    """The output of one v1 prompt."""

    text: str
    num_prompt_tokens: int
    num_completion_tokens: int
    tokens: list[TokenOutput] | None = None


# OpenAI's error types: `invalid_request_error` when the request itself cannot be served as asked (sending it
# again fails again), `server_error` when it was not served for a reason of the engine or the job
# (an engine failure, a cancelled or failed job): the same request may succeed in another run.
INVALID_REQUEST_CODES = frozenset({"invalid_request", "unsupported_field", "prompt_too_long"})


def error_type(code: str) -> str:
    return "invalid_request_error" if code in INVALID_REQUEST_CODES else "server_error"


class ErrorDetail(WireModel):
    """OpenAI's error object (`message`, `type`, `param`, `code`), so parsers of OpenAI and vLLM outputs
    read it; `type` follows from `code` when not given."""

    message: str = Field(description="What went wrong, naming the field where one is to blame.")
    # Callers may leave `type` out: the validator below fills it from `code` before the fields are read, so a
    # valid ErrorDetail always has it (the default only tells type checkers the argument is optional).
    type: str = Field("", description="OpenAI's error type: invalid_request_error or server_error.")
    param: str | None = Field(None, description="The request field to blame, where one is.")
    code: str = Field(description="Machine-readable reason, e.g. prompt_too_long, invalid_request, cancelled.")

    @model_validator(mode="before")
    @classmethod
    def _type_from_code(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") is None and isinstance(data.get("code"), str):
            return {**data, "type": error_type(data["code"])}
        return data


class ErrorOutput(WireModel):
    """Stands at the index of a request that could not be served; the rest of the batch is unaffected."""

    error: ErrorDetail
