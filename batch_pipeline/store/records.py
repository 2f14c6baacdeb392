"""A job as the store keeps it (`JobRecord`, read from its row) and as the submission path hands it in
(`NewJob`), and a page of a listing."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any

from batch_pipeline.store.results import JobResults
from batch_pipeline.store.schema import (
    FINISHED,
    JobStatus,
)
from batch_pipeline.store.sql import utc


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    owner: str
    request_json: str = field(repr=False)
    priority: str | None
    labels: dict[str, str]
    created_at: datetime
    expires_at: datetime
    run_id: str | None
    cancelled_at: datetime | None
    idempotency_key: str | None
    request_sha256: str | None = None  # what an Idempotency-Key was first used for
    status: JobStatus = JobStatus.QUEUED
    model: str | None = None
    content_path: str | None = None
    content_bytes: int | None = None
    status_detail: str | None = None
    started_at: datetime | None = None
    queue_wait_s: float | None = None
    completed_at: datetime | None = None
    failed_at: datetime | None = None
    failure_reason: str | None = None
    requests_total: int | None = None
    requests_done: int | None = None
    errors: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    results: JobResults | None = None
    resume_count: int | None = None
    resumed_from: str | None = None
    resumed_from_run_id: str | None = None
    resumed_at: datetime | None = None
    resume_idempotency_key: str | None = None
    requests_kept: int | None = None
    prompt_tokens_kept: int | None = None
    completion_tokens_kept: int | None = None
    shard_plan: str | None = None  # the shard plan of its first run (JSON), kept for every later run
    checkpoint_bytes: int | None = None
    shard_phase: str | None = None  # the furthest of its shards' (`store.progress.ShardPhase`)
    # What its first plan answered from its team's result cache, and their tokens (issue 49).
    cached_requests: int | None = None
    cached_prompt_tokens: int | None = None
    cached_completion_tokens: int | None = None

    @cached_property
    def request(self) -> dict[str, Any]:
        """The stored request, parsed when first asked for: a status read needs only a few of its fields."""
        return json.loads(self.request_json)

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED

    @property
    def stopping(self) -> bool:
        """A cancel was asked and the job has not stopped yet: its run still runs, or the results its shards
        finished are not merged into its output yet (keep_partial_results records them, or gives up). It
        reads as it did before the cancel until then: `cancelled` means stopped, its output written."""
        if self.cancelled_at is None or self.status in (JobStatus.COMPLETED, JobStatus.FAILED):
            return False
        if self.status != JobStatus.CANCELLED:
            return True
        kept = self.results is not None and self.results.dagster_run_id == self.run_id
        return self.run_id is not None and bool(self.requests_total) and not kept

    @property
    def status_read(self) -> JobStatus:
        """The status its users read: a stopping job's previous one (`stopping`)."""
        if self.status == JobStatus.CANCELLED and self.stopping:
            return JobStatus.RUNNING  # its run planned shards: it ran
        return self.status

    @classmethod
    def from_row(cls, row: Any) -> JobRecord:
        return cls(
            job_id=row.job_id,
            owner=row.owner,
            request_json=row.request,
            priority=row.priority,
            labels=json.loads(row.labels),
            created_at=utc(row.created_at),
            expires_at=utc(row.expires_at),
            run_id=row.run_id,
            cancelled_at=utc(row.cancelled_at),
            idempotency_key=row.idempotency_key,
            request_sha256=row.request_sha256,
            status=JobStatus(row.status),
            model=row.model,
            content_path=row.content_path,
            content_bytes=row.content_bytes,
            status_detail=row.status_detail,
            started_at=utc(row.started_at),
            queue_wait_s=row.queue_wait_s,
            completed_at=utc(row.completed_at),
            failed_at=utc(row.failed_at),
            failure_reason=row.failure_reason,
            requests_total=row.requests_total,
            requests_done=row.requests_done,
            errors=row.errors,
            prompt_tokens=row.prompt_tokens,
            completion_tokens=row.completion_tokens,
            results=JobResults.from_column(row.results) if row.results else None,
            resume_count=row.resume_count,
            resumed_from=row.resumed_from,
            resumed_from_run_id=row.resumed_from_run_id,
            resumed_at=utc(row.resumed_at),
            resume_idempotency_key=row.resume_idempotency_key,
            requests_kept=row.requests_kept,
            prompt_tokens_kept=row.prompt_tokens_kept,
            completion_tokens_kept=row.completion_tokens_kept,
            shard_plan=row.shard_plan,
            checkpoint_bytes=row.checkpoint_bytes,
            shard_phase=row.shard_phase,
            cached_requests=row.cached_requests,
            cached_prompt_tokens=row.cached_prompt_tokens,
            cached_completion_tokens=row.cached_completion_tokens,
        )


@dataclass(frozen=True)
class NewJob:
    """A job as the submission path hands it to the store: the request as stored (without inline content,
    which `content_path` names), and the fields the store indexes."""

    job_id: str
    owner: str
    request_json: str
    request_sha256: str  # of the request as sent, inline content included: what an Idempotency-Key means
    model: str
    priority: str | None
    labels: dict[str, str]
    max_runtime_sec: int
    content_path: str | None = None
    content_bytes: int | None = None  # the size of the file `content_path` names, when the submission wrote it
    idempotency_key: str | None = None
    # A job registered by the run that already executes it (a launchpad run) is never launched again.
    run_id: str | None = None
    # A job stored as failed (an OpenAI batch whose input did not validate): listed, never launched.
    failure_reason: str | None = None
    # The tokens it is estimated to use: held against its team's max_tokens_per_day until it ends.
    estimated_tokens: int | None = None
    # The kind of its requests where the request says it (`contract/kinds`' name); else its plan records it.
    request_kind: str | None = None

    @staticmethod
    def new_id() -> str:
        return f"batch-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Page:
    jobs: list[JobRecord]
    next_after: str | None  # the cursor of the next page; None on the last one
