"""Batch jobs as the API reports them, and the bodies of the job routes."""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import Field, field_serializer

from batch_pipeline.contract.base import WireModel
from batch_pipeline.contract.model_config import BatchCompletionsModelConfig
from batch_pipeline.contract.requests import InputDataPath, OutputDataPath, Priority


class BatchCompletionsJobStatus(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"


class BatchCompletionsJob(WireModel):
    job_id: str
    input_data_path: InputDataPath = None
    output_data_path: OutputDataPath
    model_cfg: BatchCompletionsModelConfig = Field(alias="model_config")
    priority: Priority = None
    status: BatchCompletionsJobStatus
    created_at: str
    expires_at: str
    completed_at: str | None
    metadata: dict[str, str] | None

    @field_serializer("model_cfg")
    def _model_config_as_asked(self, model_cfg: BatchCompletionsModelConfig) -> dict[str, Any]:
        # Its ~40 other fields are nullable and not required in the spec's shape: a job says the ones its
        # request set (and `model`), not a null for each (issue 46).
        return model_cfg.model_dump(mode="json", by_alias=True, exclude_none=True)


class CreateBatchCompletionsV1Response(WireModel):
    job_id: str


CreateBatchCompletionsV2Response = BatchCompletionsJob


class GetBatchCompletionV2Response(WireModel):
    job: BatchCompletionsJob


class ListBatchCompletionV2Response(WireModel):
    """Not a route of the spec: a page of jobs, newest first, paged as OpenAI's lists are (`after` =
    the previous page's `last_id`)."""

    jobs: list[BatchCompletionsJob]
    has_more: bool = False
    last_id: str | None = None


class UpdateBatchCompletionsV2Request(WireModel):
    job_id: str
    priority: str | None = None


class UpdateBatchCompletionsV2Response(BatchCompletionsJob):
    success: bool


class CancelBatchCompletionsV2Response(WireModel):
    success: bool
    # Not in the spec's shape, which clients parse ignoring what they do not know (the llmengine SDK's
    # pydantic model does): why nothing was cancelled, left out when something was.
    reason: str | None = Field(
        None, description="Why the job was not cancelled (it had ended already); absent when success is true"
    )
