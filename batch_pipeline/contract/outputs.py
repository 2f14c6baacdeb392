"""What a batch job writes: one entry per request, in input order."""

from __future__ import annotations

from pydantic import Field

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


class ErrorDetail(WireModel):
    code: str = Field(description="Machine-readable reason, e.g. prompt_too_long, invalid_request.")
    message: str = Field(description="What went wrong, naming the field where one is to blame.")


class ErrorOutput(WireModel):
    """Stands at the index of a request that could not be served; the rest of the batch is unaffected."""

    error: ErrorDetail
