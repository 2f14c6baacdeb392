"""What the routes do: jobs in the store, their status read from the store and the Dagster run.

Knows nothing of HTTP; raises domain errors that the routes map to status codes.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

import dagster as dg
from dagster import DagsterEventType, DagsterRunStatus
from pydantic import Field, ValidationError

from batch_pipeline import io
from batch_pipeline.api.auth import Caller
from batch_pipeline.capabilities import refusals
from batch_pipeline.contract import (
    BatchCompletionsJob,
    BatchCompletionsJobStatus,
    BatchCompletionsModelConfig,
    CreateBatchCompletionsV2Request,
)
from batch_pipeline.contract.base import WireModel
from batch_pipeline.jobs_store import IdempotencyConflict, JobRecord, JobStore
from batch_pipeline.pipeline.job import metadata_path
from batch_pipeline.pipeline.resources import JobStorage
from batch_pipeline.pipeline.sensors import find_run
from batch_pipeline.priority import run_priority
from batch_pipeline.shards import generated_tokens, progress

_STATUS = {
    DagsterRunStatus.QUEUED: BatchCompletionsJobStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED: BatchCompletionsJobStatus.QUEUED,
    DagsterRunStatus.STARTING: BatchCompletionsJobStatus.QUEUED,
    DagsterRunStatus.STARTED: BatchCompletionsJobStatus.RUNNING,
    DagsterRunStatus.SUCCESS: BatchCompletionsJobStatus.COMPLETED,
    DagsterRunStatus.FAILURE: BatchCompletionsJobStatus.FAILED,
    DagsterRunStatus.CANCELING: BatchCompletionsJobStatus.CANCELLED,
    DagsterRunStatus.CANCELED: BatchCompletionsJobStatus.CANCELLED,
}
_NOT_STARTED = {DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED}
# Metadata of the finished job copied into the API's view of it.
_RESULT_FIELDS = ("num_requests", "num_errors", "prompt_tokens", "completion_tokens", "completion_tokens_per_s", "wall_s")


__all__ = ["BatchJobService", "IdempotencyConflict", "JobNotFound", "UnservableRequest"]


class JobNotFound(LookupError):
    pass


class _StoredRequestView(WireModel):
    """What a status read needs of a stored request; pydantic reads it from the stored JSON without
    building the rest (inline content can be tens of MB)."""

    input_data_path: str | None = None
    output_data_path: str
    model_cfg: BatchCompletionsModelConfig = Field(alias="model_config")


def _stored_request_view(record: JobRecord) -> _StoredRequestView:
    try:
        return _StoredRequestView.model_validate_json(record.request_json)
    except ValidationError:
        # A row an older release stored that no longer validates (the sensor fails such a job with the
        # reason): it is still described, with the parts that cannot be shown left empty.
        return _StoredRequestView(output_data_path="", model_config=BatchCompletionsModelConfig(model=""))


class UnservableRequest(ValueError):
    """A request the contract accepts but this deployment cannot run: `(field, why)` for each part."""

    def __init__(self, refused: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{field}: {why}" for field, why in refused))
        self.refused = refused


class BatchJobService:
    def __init__(self, store: JobStore, instance: dg.DagsterInstance, job_storage: JobStorage) -> None:
        self.store = store
        self.instance = instance
        self.job_storage = job_storage

    def create(
        self, caller: Caller, request: CreateBatchCompletionsV2Request, idempotency_key: str | None
    ) -> BatchCompletionsJob:
        run_priority(request.priority)  # InvalidPriority names the field
        if refused := refusals(request):
            raise UnservableRequest(refused)
        record, created = self.store.create(caller.owner, request, request.max_runtime_sec or 86400, idempotency_key)
        if not created:
            return self.describe(record)
        # A new job is described from the request in hand rather than by parsing back what was just stored.
        view = _StoredRequestView(input_data_path=request.input_data_path,
                                  output_data_path=request.output_data_path, model_config=request.model_cfg)
        return self.describe(record, view)

    def get(self, caller: Caller, job_id: str) -> BatchCompletionsJob:
        return self.describe(self._record(caller, job_id))

    def list(
        self, caller: Caller, status: BatchCompletionsJobStatus | None = None, label: dict[str, str] | None = None
    ) -> list[BatchCompletionsJob]:
        records = self.store.list(owner=None if caller.is_admin else caller.owner)
        if label:
            records = [r for r in records if all(r.labels.get(k) == v for k, v in label.items())]
        described = [self.describe(record) for record in records]
        return [job for job in described if status is None or job.status == status]

    def update_priority(self, caller: Caller, job_id: str, priority: str | None) -> tuple[BatchCompletionsJob, bool]:
        """Reprioritise a job that has not started: in the store before launch, on the queued run after."""
        run_priority(priority)
        record = self._record(caller, job_id)
        run = self._run(record)
        if record.cancelled_at is not None or record.failed_at is not None or (
            run is not None and run.status not in _NOT_STARTED
        ):
            return self.describe(record), False
        if run is not None:
            self.instance.add_run_tags(run.run_id, {"dagster/priority": str(run_priority(priority))})
        self.store.set_priority(job_id, priority)
        return self.describe(self.store.get(job_id)), True

    def cancel(self, caller: Caller, job_id: str) -> bool:
        record = self._record(caller, job_id)
        if record.cancelled_at is not None:
            return True
        run = self._run(record)
        if run is None and record.failed_at is not None:
            return False  # it never became a run, and is finished
        if run is None:
            cancelled_before_launch = self.store.cancel_before_launch(job_id)
            # The sensor may have asked for the run just before: look again, and stop that run too.
            run = find_run(self.instance, job_id)
            if run is None:
                return cancelled_before_launch
        if run.is_finished:
            return run.status == DagsterRunStatus.CANCELED
        cancelled = self.instance.run_coordinator.cancel_run(run.run_id)
        if cancelled:
            self.store.mark_cancelled(job_id)
        return cancelled

    def describe(self, record: JobRecord, request: _StoredRequestView | None = None) -> BatchCompletionsJob:
        run = self._run(record)
        request = request or _stored_request_view(record)
        metadata: dict[str, str] = {"labels": json.dumps(record.labels)} if record.labels else {}
        completed_at = (record.cancelled_at or record.failed_at) if run is None else None
        if run is None and record.failed_at is not None:
            status = BatchCompletionsJobStatus.FAILED
            metadata["failure_reason"] = record.failure_reason or "the job could not start"
        elif run is None:
            status = BatchCompletionsJobStatus.CANCELLED if record.cancelled_at else BatchCompletionsJobStatus.QUEUED
        else:
            status = _STATUS.get(run.status, BatchCompletionsJobStatus.UNKNOWN)
            metadata["dagster_run_id"] = run.run_id
            metadata.update(self._progress(record))
            if run.is_complete_and_waiting_to_retry:
                # Its run worker died and the daemon is about to retry it: the job goes on.
                status = BatchCompletionsJobStatus.RUNNING
                metadata["retrying_after"] = self._failure_reason(run.run_id)
            else:
                if run.is_finished:
                    completed_at = self._end_time(run.run_id)
                    metadata.update(self._results(request.output_data_path))
                if run.status == DagsterRunStatus.FAILURE:
                    metadata["failure_reason"] = self._failure_reason(run.run_id)
                elif status == BatchCompletionsJobStatus.CANCELLED and self._stopped_by_deadline(record, completed_at):
                    # Nobody cancelled it: Dagster's run monitoring stopped a run past its max_runtime.
                    status = BatchCompletionsJobStatus.FAILED
                    metadata["failure_reason"] = "max_runtime_sec exceeded: the run was stopped by run monitoring"
        return BatchCompletionsJob(
            job_id=record.job_id,
            input_data_path=request.input_data_path,
            output_data_path=request.output_data_path,
            model_config=request.model_cfg,
            priority=record.priority,
            status=status,
            created_at=record.created_at.isoformat(),
            expires_at=record.expires_at.isoformat(),
            completed_at=completed_at.isoformat() if completed_at else None,
            metadata=metadata,
        )

    @staticmethod
    def _stopped_by_deadline(record: JobRecord, ended_at: datetime | None) -> bool:
        return record.cancelled_at is None and ended_at is not None and ended_at >= record.expires_at

    def _record(self, caller: Caller, job_id: str) -> JobRecord:
        record = self.store.get(job_id)
        # Someone else's job is reported as absent, not forbidden: its existence is not ours to reveal.
        if record is None or (record.owner != caller.owner and not caller.is_admin):
            raise JobNotFound(job_id)
        return record

    def _run(self, record: JobRecord) -> dg.DagsterRun | None:
        """The job's newest run: a re-execution from the UI carries the job id too and supersedes the first."""
        run = find_run(self.instance, record.job_id)
        if run is not None and record.run_id is None:
            self.store.link_run(record.job_id, run.run_id)
        return run

    def _progress(self, record: JobRecord) -> dict[str, str]:
        work_dir = self.job_storage.work_dir(record.job_id)
        done, total = progress(work_dir)
        if not total:
            return {}
        return {"requests_done": str(done), "requests_total": str(total),
                "completion_tokens_generated": str(generated_tokens(work_dir))}

    def _results(self, output_data_path: str) -> dict[str, str]:
        path = metadata_path(output_data_path)
        try:
            if not io.exists(path):
                return {}
            with io.open_file(path, "r") as handle:
                written = json.load(handle)
        except (OSError, ValueError):  # e.g. a job stored before the path policy, naming what cannot be read
            return {}
        return {key: str(written[key]) for key in _RESULT_FIELDS if written.get(key) is not None}

    def _end_time(self, run_id: str) -> datetime | None:
        records = self.instance.get_run_records(filters=dg.RunsFilter(run_ids=[run_id]), limit=1)
        if records and records[0].end_time:
            return datetime.fromtimestamp(records[0].end_time, tz=timezone.utc)
        return None

    def _failure_reason(self, run_id: str) -> str:
        failures = self.instance.all_logs(run_id, of_type={DagsterEventType.STEP_FAILURE, DagsterEventType.RUN_FAILURE})
        for entry in failures:
            event = entry.dagster_event
            if event and event.is_step_failure:
                # A dg.Failure carries the sentence meant for users; anything else, the error's message.
                user_failure = event.step_failure_data.user_failure_data
                if user_failure and user_failure.description:
                    return user_failure.description
                if event.step_failure_data.error:
                    return event.step_failure_data.error.message.strip()
        return failures[-1].message if failures else "the run failed"
