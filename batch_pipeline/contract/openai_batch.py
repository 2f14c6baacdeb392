"""OpenAI's Batch API as the `openai` SDK speaks it: files, batches, and the lines of their JSONL files
(see shared/spec/openai_batch.md). Times are unix seconds, as OpenAI's are."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, create_model, field_validator

from batch_pipeline.contract.base import WireModel
from batch_pipeline.contract.kinds import BATCH_ENDPOINTS
from batch_pipeline.contract.labels import OpenAIMetadata
from batch_pipeline.contract.requests import ResultCacheMode

# The endpoints a batch may target: those of the registry's kinds (contract/kinds).
if TYPE_CHECKING:
    BatchEndpoint = str
else:
    BatchEndpoint = Literal[tuple(BATCH_ENDPOINTS)]
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
FilePurpose = Literal["batch", "batch_output"]
# OpenAI's bounds of a file's `expires_after.seconds`: an hour to 30 days.
MIN_EXPIRES_AFTER_S, MAX_EXPIRES_AFTER_S = 3600, 2592000


class ExpiresAfter(WireModel):
    """OpenAI's expiration policy of a file: it expires `seconds` after its `anchor` (its creation)."""

    anchor: Literal["created_at"] = Field(description="The time the expiry counts from: the file's creation")
    seconds: int = Field(
        ge=MIN_EXPIRES_AFTER_S,
        le=MAX_EXPIRES_AFTER_S,
        description="Seconds after the anchor at which the file expires: 3600 (an hour) to 2592000 (30 days)",
    )


class OpenAIFile(WireModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose
    expires_at: int | None = Field(
        None, description="When the file expires (unix seconds): from then on it is absent (404); null: never"
    )
    # Kept by OpenAI for older clients; always "processed" once stored.
    status: Literal["processed"] = "processed"


class FileList(WireModel):
    object: Literal["list"] = "list"
    data: list[OpenAIFile]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(WireModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class CreateBatchRequest(WireModel):
    input_file_id: str = Field(max_length=64)
    endpoint: BatchEndpoint
    completion_window: str = Field(
        "24h",
        pattern=r"^[1-9][0-9]?h$",
        description="Hours the batch may take (OpenAI's is 24h): its max_runtime_sec, at most 48h here.",
    )
    metadata: OpenAIMetadata = Field(
        None,
        description="The batch's job labels, bounded as OpenAI's: at most 16 pairs, keys up to 64 characters, "
        "values up to 512.",
    )
    cache: ResultCacheMode = "on"  # not OpenAI's: the team's result cache (`extra_body={"cache": "off"}`)
    output_expires_after: ExpiresAfter | None = Field(
        None,
        description="When the batch's output and error files expire, counted from their creation (OpenAI's bounds: "
        "3600 to 2592000 seconds); unset: they are kept until deleted",
    )

    @field_validator("completion_window")
    @classmethod
    def _within_two_days(cls, value: str) -> str:
        if int(value[:-1]) > 48:
            raise ValueError("at most 48h")
        return value

    @property
    def window_seconds(self) -> int:
        return int(self.completion_window[:-1]) * 3600


class BatchError(WireModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(WireModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchRequestCounts(WireModel):
    total: int
    completed: int
    failed: int


class BatchInputTokensDetails(WireModel):
    cached_tokens: int = Field(
        0,
        description="Prompt tokens of the requests the team's result cache answered (vLLM's prefix cache: not counted)",
    )


class BatchOutputTokensDetails(WireModel):
    reasoning_tokens: int = Field(0, description="Reasoning tokens: not told apart here, 0")


class BatchUsage(WireModel):
    """OpenAI's batch `usage` (since 2025): the batch's job's prompt and completion tokens."""

    input_tokens: int
    input_tokens_details: BatchInputTokensDetails = Field(default_factory=BatchInputTokensDetails)
    output_tokens: int
    output_tokens_details: BatchOutputTokensDetails = Field(default_factory=BatchOutputTokensDetails)
    total_tokens: int


class Batch(WireModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None = None
    model: str | None = Field(None, description="The model of the batch's lines (one per file)")
    usage: BatchUsage | None = Field(
        None,
        description="The tokens of the batch's job so far (its prompt and completion tokens); null before it has any",
    )


class BatchList(WireModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class BatchInputLineBase(WireModel):
    """The fields of a batch input line besides its body: the base of lines whose body has a model."""

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str = Field(max_length=256)


class BatchInputLine(BatchInputLineBase):
    """One line of a batch's input file."""

    body: dict[str, Any]


# A line of each endpoint, its body the endpoint's kind's wire model: parsed and validated in one pass.
BATCH_LINES: dict[str, type[BatchInputLineBase]] = {
    url: create_model(f"{kind.name.title()}BatchInputLine", __base__=BatchInputLineBase, body=(kind.wire_model, ...))
    for url, kind in BATCH_ENDPOINTS.items()
}


class OpenAIError(WireModel):
    """OpenAI's error object: what its SDK reads from a failed call's body (`{"error": {...}}`)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(WireModel):
    error: OpenAIError
