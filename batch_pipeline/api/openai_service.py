"""What the OpenAI Batch API's routes do: files kept in the file store, batches made as jobs through the
submission path (the same store, the same Dagster job) and described from their job's row. Knows nothing of
HTTP; raises domain errors that the routes map to OpenAI's error bodies."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import IO, Any

from pydantic import ValidationError

from batch_pipeline.admission.output_room import BATCH_OUTPUT_COPIES
from batch_pipeline.admission.policy import AdmissionPolicy
from batch_pipeline.admission.submission import (
    CONTENT_FILE,
    StoredBytes,
    StoredRequest,
    UnservableRequest,
    check_queue_quota,
    check_servable,
    check_tokens_quota,
    hold_stored_bytes,
    stored_bytes_of,
    submit,
)
from batch_pipeline.api.auth import Caller
from batch_pipeline.api.service import BatchJobService
from batch_pipeline.contract import BatchCompletionsEstimate, CreateBatchCompletionsV2Request
from batch_pipeline.contract.kinds import BATCH_ENDPOINTS
from batch_pipeline.contract.openai_batch import (
    Batch,
    BatchError,
    BatchErrors,
    BatchInputTokensDetails,
    BatchRequestCounts,
    BatchUsage,
    CreateBatchRequest,
    ExpiresAfter,
    FileDeleted,
    OpenAIFile,
)
from batch_pipeline.contract.records import describe_validation_error
from batch_pipeline.core import io
from batch_pipeline.core.io import make_private_directory
from batch_pipeline.core.slots import SlotsBusy, TeamSlots
from batch_pipeline.dry_run.estimate import HISTORY_JOBS, DryRunsBusy
from batch_pipeline.openai_batch.jobs import (
    CUSTOM_IDS_FILE,
    OUTPUT_FILE,
    BatchApiLimits,
    CheckedInput,
    check_input_file,
    expired,
    keep_results,
    model_config_for,
    runner_refusal,
    write_result_files,
)
from batch_pipeline.store.openai import BatchRecord, FileRecord, OpenAIStore
from batch_pipeline.store.records import JobRecord, NewJob
from batch_pipeline.store.schema import JobStatus

_CHUNK = 1024 * 1024


class BatchChecksBusy(SlotsBusy):
    """As many batch input files as this process, or the caller's team, checks at once are being checked."""


class FileNotFound(LookupError):
    """No such file for the caller (absent, another team's, or expired); `param` names the field."""

    def __init__(self, file_id: str, param: str = "file_id") -> None:
        super().__init__(file_id)
        self.param = param


class BatchNotFound(LookupError):
    pass


class InvalidOpenAIRequest(ValueError):
    """A request OpenAI would answer with 400 `invalid_request_error`: the message names `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class OpenAIBatchService:
    def __init__(self, jobs: BatchJobService, limits: BatchApiLimits, store: OpenAIStore | None = None) -> None:
        self.jobs = jobs
        self.limits = limits
        self.store = store or OpenAIStore(engine=jobs.store.engine)
        self.files_dir = jobs.job_storage.files_dir()
        # Checking a batch's input file reads all of it in a worker thread (up to 200 MiB): without a bound,
        # one team's burst of batches over one large file held every thread, and every other route waited.
        self.batch_checks = TeamSlots(
            "batch input files being checked",
            limits.max_concurrent_batch_checks,
            limits.max_batch_checks_per_team,
            "BATCH_PIPELINE_MAX_BATCH_CHECKS_PER_TEAM",
            busy=BatchChecksBusy,
        )

    # --- files ------------------------------------------------------------------------------------------

    def stored_bytes(self, caller: Caller) -> StoredBytes | None:
        """The caller's team's stored bytes against its max_stored_bytes (None without one)."""
        return stored_bytes_of(self.jobs.store, caller.owner, self.jobs.admission.team_of_owner(caller.owner))

    def upload(
        self,
        caller: Caller,
        filename: str,
        purpose: str,
        content: IO[bytes],
        expires_after: ExpiresAfter | None = None,
    ) -> OpenAIFile:
        """Store an uploaded file, copied a chunk at a time from the spooled upload; past the team's
        max_stored_bytes, QuotaExceeded and nothing kept. With `expires_after`, it expires that many seconds
        after its creation: absent from then on, and deleted by the `cleanup` schedule."""
        if purpose != "batch":
            raise InvalidOpenAIRequest(
                "purpose", f"purpose must be 'batch' (got {purpose[:64]!a}): files here are inputs of batches"
            )
        # Shown back as sent, but stored as text any database holds: no NUL, no lone surrogate, no control.
        filename = "".join(character for character in filename if character.isprintable())[:256]
        created_at = datetime.now(UTC)
        record = FileRecord(
            file_id=FileRecord.new_id(),
            owner=caller.owner,
            filename=filename or "upload.jsonl",
            purpose=purpose,
            bytes=0,
            created_at=created_at,
            path="",
            expires_at=created_at + timedelta(seconds=expires_after.seconds) if expires_after else None,
        )
        path = io.join(self.files_dir, record.file_id)
        start = content.tell()
        size = content.seek(0, os.SEEK_END) - start
        content.seek(start)
        if size == 0:
            raise InvalidOpenAIRequest("file", "the file is empty")
        # Held against the team's max_stored_bytes from before the copy until its row is stored.
        team = self.jobs.admission.team_of_owner(caller.owner)
        with hold_stored_bytes(self.jobs.store, caller.owner, team, size, "this upload"):
            _make_work_dir(self.files_dir)
            try:
                with io.atomic_write(path, "wb") as stored:
                    shutil.copyfileobj(content, stored, _CHUNK)
                record = FileRecord(**{**record.__dict__, "bytes": io.size(path), "path": path})
                self.store.add_file(record)
            except BaseException:
                with contextlib.suppress(OSError):
                    io.remove(path)  # no row, no file
                raise
        return describe_file(record)

    def get_file(self, caller: Caller, file_id: str) -> OpenAIFile:
        return describe_file(self._file(caller, file_id))

    def list_files(
        self, caller: Caller, purpose: str | None, limit: int, after: str | None
    ) -> tuple[list[OpenAIFile], bool]:
        records, more = self.store.list_files(None if caller.is_admin else caller.owner, purpose, limit, after)
        return [describe_file(record) for record in records], more

    def delete_file(self, caller: Caller, file_id: str) -> FileDeleted:
        record = self._file(caller, file_id)
        deleted = self.store.delete_file(record.file_id)
        io.remove(record.path)
        return FileDeleted(id=record.file_id, deleted=deleted)

    def file_chunks(self, caller: Caller, file_id: str) -> tuple[OpenAIFile, Iterator[bytes]]:
        """The file and its content, a chunk at a time (opened now, so a missing file fails here)."""
        record = self._file(caller, file_id)
        try:
            handle = io.open_file(record.path, "rb")
        except FileNotFoundError:
            raise FileNotFound(file_id) from None

        def chunks() -> Iterator[bytes]:
            with handle:
                while chunk := handle.read(_CHUNK):
                    yield chunk

        return describe_file(record), chunks()

    def _file(self, caller: Caller, file_id: str, param: str = "file_id") -> FileRecord:
        record = self.store.get_file(file_id)
        # Someone else's file is reported as absent, as their jobs are; so is an expired one, from the
        # moment it expires, whether or not the cleanup has deleted it yet.
        if record is None or (record.owner != caller.owner and not caller.is_admin) or record.expired():
            raise FileNotFound(file_id, param)
        return record

    # --- batches ----------------------------------------------------------------------------------------

    def create_batch(self, caller: Caller, body: CreateBatchRequest) -> Batch:
        """Check the input file now (OpenAI's `validating`, done before answering) and make the batch's job:
        queued when every line is valid, else stored failed with the errors by line, never launched."""
        input_file = self._input_file(caller, body.input_file_id)
        team = self.jobs.admission.team_of_owner(caller.owner)
        check_queue_quota(self.jobs.store, caller.owner, team)  # before the file is read and copied
        check_tokens_quota(self.jobs.store, caller.owner, team)
        job_id = NewJob.new_id()
        work_dir = self.jobs.job_storage.work_dir(job_id)
        # The job keeps a copy of the file (its content, its custom ids): held against the team's
        # max_stored_bytes from before it is written, and counted as the job's content once it is stored.
        copying = hold_stored_bytes(
            self.jobs.store, caller.owner, team, input_file.bytes, "this batch's copy of its file"
        )
        with copying:
            return self._create_batch(caller, body, input_file, job_id, work_dir)

    def _create_batch(
        self, caller: Caller, body: CreateBatchRequest, input_file: FileRecord, job_id: str, work_dir: str
    ) -> Batch:
        _make_work_dir(work_dir)
        try:
            checked = self._check(caller, input_file, body, work_dir)
            if not checked.errors:
                self._check_output_room(caller, checked)
        except BaseException:
            io.remove_tree(work_dir)
            raise
        errors = list(checked.errors)
        request = None
        if not errors:
            try:
                request = _job_request(
                    checked, body, work_dir, caller.owner, self.jobs.admission, self.limits, dry_run=False
                )
                self.jobs.check_model(caller, request)
            except (ValidationError, ValueError, OSError) as exc:
                errors = _model_errors(exc)
                request = None
            except DryRunsBusy:  # nothing stored: the caller tries again
                io.remove_tree(work_dir)
                raise
        if request is None:  # stored as it was asked for, to be described; its content was never kept
            request = StoredRequest(
                content_path=io.join(work_dir, CONTENT_FILE),
                output_data_path=io.join(work_dir, OUTPUT_FILE),
                model_cfg={"model": (checked.model or "")[:256]},
                max_runtime_sec=body.window_seconds,
                labels=body.metadata or {},
            )
        failure = None
        if errors:
            shown = "; ".join(f"line {e.line}: {e.message}" if e.line else e.message for e in errors[:3])
            failure = f"the input file did not validate ({len(errors) + checked.more_errors} errors): {shown}"
        batch = BatchRecord(
            batch_id=job_id,
            owner=caller.owner,
            endpoint=body.endpoint,
            input_file_id=input_file.file_id,
            completion_window=body.completion_window,
            created_at=datetime.now(UTC),
            total=checked.total,
            errors=[error.model_dump() for error in errors] or None,
            output_expires_after=body.output_expires_after.seconds if body.output_expires_after else None,
        )
        # Before the job: the pipeline finalizes a job as a batch when it finds this row.
        self.store.add_batch(batch)
        try:
            job, _ = submit(
                self.jobs.store,
                self.jobs.job_storage.work_dir,
                caller.owner,
                request,
                self.jobs.admission,
                job_id=job_id,
                failure_reason=failure,
                content_bytes=_bytes_under(work_dir),
                request_kind=BATCH_ENDPOINTS[body.endpoint].name,
            )
        except BaseException:
            self.store.delete_batch(job_id)
            io.remove_tree(work_dir)  # no batch, no copy of its file
            raise
        return describe_batch(batch, job)

    def estimate_batch(self, caller: Caller, body: CreateBatchRequest) -> BatchCompletionsEstimate:
        """A dry run: the input file checked as `create_batch` checks it, then read and tokenized as its job
        would be (`estimate`); nothing is stored or launched, and the file's checked copy is removed."""
        input_file = self._input_file(caller, body.input_file_id)
        work_dir = self.jobs.job_storage.work_dir(f"dry-run-{uuid.uuid4().hex}")
        _make_work_dir(work_dir)
        try:
            checked = self._check(caller, input_file, body, work_dir)
            if checked.errors:
                shown = "; ".join(f"line {e.line}: {e.message}" if e.line else e.message for e in checked.errors[:3])
                raise InvalidOpenAIRequest(
                    "input_file_id",
                    f"the input file does not validate ({len(checked.errors) + checked.more_errors} errors): {shown}",
                )
            try:
                request = _job_request(
                    checked, body, work_dir, caller.owner, self.jobs.admission, self.limits, dry_run=True
                )
                history = self.jobs.reports.completed_figures(request.model_cfg.model, HISTORY_JOBS)
                files = self.jobs.admission.data_files(caller.owner, own_dir=work_dir)
                return self.jobs.dry_runs.estimate(request, history, files, team=caller.owner)
            except (ValidationError, UnservableRequest, OSError) as exc:
                raise InvalidOpenAIRequest("body.model", _model_errors(exc)[0].message) from None
        finally:
            io.remove_tree(work_dir)

    def get_batch(self, caller: Caller, batch_id: str) -> Batch:
        return describe_batch(*self._batch(caller, batch_id))

    def list_batches(self, caller: Caller, limit: int, after: str | None) -> tuple[list[Batch], bool]:
        records, more = self.store.list_batches(None if caller.is_admin else caller.owner, limit, after)
        described = []
        for record in records:
            job = self.jobs.store.get(record.batch_id)
            if job is not None:
                described.append(describe_batch(record, job))
        return described, more

    def cancel_batch(self, caller: Caller, batch_id: str) -> Batch:
        batch, job = self._batch(caller, batch_id)
        if job.is_finished and job.status != JobStatus.CANCELLED:
            raise InvalidOpenAIRequest("batch_id", f"the batch is already {describe_batch(batch, job).status}")
        self.jobs.cancel(caller, batch_id)
        batch, job = self._batch(caller, batch_id)
        if job.cancelled_at is not None and not job.requests_total and batch.finalized_at is None:
            # Stopped before its shards were planned: no run keeps partial results, so its error file (every
            # request cancelled) is written here.
            work_dir = self.jobs.job_storage.work_dir(batch_id)
            unfinished = {"error": {"code": "cancelled", "message": "the batch was cancelled before this request ran"}}
            results = write_result_files(
                batch_id,
                batch.owner,
                io.join(work_dir, CUSTOM_IDS_FILE),
                (unfinished for _ in range(batch.total)),
                self.files_dir,
            )
            keep_results(self.store, batch_id, results)
            batch, job = self._batch(caller, batch_id)
        return describe_batch(batch, job)

    def _input_file(self, caller: Caller, file_id: str) -> FileRecord:
        # A file that is not the caller's (none, another team's, expired) is the 404 its GET answers, as
        # OpenAI's: not a 400 here and a 404 there.
        input_file = self._file(caller, file_id, "input_file_id")
        if input_file.purpose != "batch":
            raise InvalidOpenAIRequest("input_file_id", "the input file must be one uploaded with purpose 'batch'")
        return input_file

    def _check(self, caller: Caller, input_file: FileRecord, body: CreateBatchRequest, work_dir: str) -> CheckedInput:
        try:
            with self.batch_checks.hold(caller.owner):  # a whole file read and checked in this thread
                return check_input_file(
                    input_file.path, body.endpoint, work_dir, self.limits.max_batch_requests, self.limits.model_catalog
                )
        except FileNotFoundError:
            raise InvalidOpenAIRequest("input_file_id", "the file's content is no longer stored") from None

    def _check_output_room(self, caller: Caller, checked: CheckedInput) -> None:
        """QuotaExceeded, naming `input_file_id`, when the batch's outputs (its file's copy held already) would
        take its team past max_stored_bytes: estimated as its lines were checked, for a kind whose tokens do
        not bound them (embeddings)."""
        stored = self.stored_bytes(caller)
        if stored is not None and checked.output.requests:
            refused = checked.output.refusal(stored, BATCH_OUTPUT_COPIES, "this batch", param="input_file_id")
            if refused is not None:
                raise refused

    def _batch(self, caller: Caller, batch_id: str) -> tuple[BatchRecord, JobRecord]:
        batch = self.store.get_batch(batch_id)
        if batch is None or (batch.owner != caller.owner and not caller.is_admin):
            raise BatchNotFound(batch_id)
        job = self.jobs.store.get(batch_id)
        if job is None:
            raise BatchNotFound(batch_id)
        return batch, job


def _job_request(
    checked: CheckedInput,
    body: CreateBatchRequest,
    work_dir: str,
    owner: str,
    admission: AdmissionPolicy,
    limits: BatchApiLimits,
    dry_run: bool,
) -> CreateBatchCompletionsV2Request:
    """The job request of a batch whose input checked clean, its content and output in the job's work dir;
    raises what makes its model unservable. A dry run reads the content as an input file (no job names it
    as its own)."""
    # Each line of a file without errors names the model, and such a file has at least one line.
    assert checked.model is not None
    content, output = io.join(work_dir, CONTENT_FILE), io.join(work_dir, OUTPUT_FILE)
    fields: dict[str, Any] = {
        "output_data_path": output,
        "model_cfg": model_config_for(checked.model, limits.model_catalog),
        "max_runtime_sec": body.window_seconds,
        "labels": body.metadata or {},
        "cache": body.cache,
    }
    request = (
        CreateBatchCompletionsV2Request(input_data_path=content, **fields)
        if dry_run
        else StoredRequest(content_path=content, **fields)
    )
    check_servable(request, owner, admission, own_dir=work_dir)
    resolved = request.model_cfg.model
    if resolved != checked.model and (refusal := runner_refusal(resolved, body.endpoint)) is not None:
        # an operator's name for a catalog model (BATCH_PIPELINE_MODEL_CATALOG) that cannot serve the endpoint
        raise UnservableRequest([("model_config.model", refusal)])
    return request


def _make_work_dir(path: str) -> None:
    if io.is_local(path):  # tenants' prompts: for the service's user alone
        make_private_directory(path)
    else:
        io.makedirs(path)


def _model_errors(exc: Exception) -> list[BatchError]:
    if isinstance(exc, UnservableRequest):
        return [
            BatchError(
                code="model_not_served" if field.startswith("model_config") else "invalid_request",
                message=f"{field}: {why}",
                param="body.model",
            )
            for field, why in exc.refused
        ]
    if isinstance(exc, ValidationError):
        return [
            BatchError(
                code="invalid_model",
                param="body.model",
                message=f"the model catalog's entry does not validate: {describe_validation_error(exc)}",
            )
        ]
    return [BatchError(code="invalid_model", param="body.model", message=str(exc)[:500])]


def describe_file(record: FileRecord) -> OpenAIFile:
    return OpenAIFile(
        id=record.file_id,
        bytes=record.bytes,
        created_at=_unix(record.created_at),
        filename=record.filename,
        purpose=record.purpose,
        expires_at=_unix(record.expires_at),
    )


def describe_batch(batch: BatchRecord, job: JobRecord) -> Batch:
    """The batch as OpenAI's object: its status and counts from its job's row, its files from its own."""
    ended = _unix(job.completed_at)
    timestamps: dict[str, int | None] = {"in_progress_at": _unix(job.started_at)}
    if batch.errors:
        status, timestamps = "failed", {"failed_at": _unix(job.failed_at or job.completed_at)}
    elif job.stopping:  # cancelled once its run has stopped and its finished work is written
        status, timestamps = "cancelling", timestamps | {"cancelling_at": _unix(job.cancelled_at)}
    elif job.status in (JobStatus.QUEUED, JobStatus.RUNNING):
        total = job.requests_total or 0
        status = "finalizing" if total and (job.requests_done or 0) >= total else "in_progress"
    elif job.status == JobStatus.COMPLETED:
        status = "completed" if batch.finalized_at else "finalizing"
        timestamps |= {"finalizing_at": ended, "completed_at": _unix(batch.finalized_at)}
    elif job.status == JobStatus.CANCELLED:
        # Not stopping: its finished work is written (by the run that keeps partial results, if its shards
        # were planned).
        status = "cancelled"
        timestamps |= {"cancelling_at": _unix(job.cancelled_at), "cancelled_at": _unix(batch.finalized_at) or ended}
    elif expired(job):
        status, timestamps = "expired", timestamps | {"expired_at": ended}
    else:
        status, timestamps = "failed", timestamps | {"failed_at": ended}
    errors = batch.errors
    if status == "failed" and not errors and job.status == JobStatus.FAILED:
        errors = [{"code": "batch_failed", "message": job.failure_reason or "the batch's job failed"}]
    if batch.finalized_at is not None:
        counts = BatchRequestCounts(total=batch.total, completed=batch.completed or 0, failed=batch.failed or 0)
    else:
        failed = job.errors or 0
        counts = BatchRequestCounts(
            total=batch.total, completed=max(0, (job.requests_done or 0) - failed), failed=failed
        )
    return Batch(
        id=batch.batch_id,
        endpoint=batch.endpoint,
        errors=BatchErrors(data=[BatchError.model_validate(error) for error in errors]) if errors else None,
        input_file_id=batch.input_file_id,
        completion_window=batch.completion_window,
        status=status,
        output_file_id=batch.output_file_id,
        error_file_id=batch.error_file_id,
        created_at=_unix(batch.created_at),
        expires_at=_unix(batch.created_at + timedelta(hours=int(batch.completion_window[:-1]))),
        request_counts=counts,
        metadata=job.labels or None,
        model=job.model,
        usage=_usage(job),
        **timestamps,
    )


def _usage(job: JobRecord) -> BatchUsage | None:
    """The batch's tokens as its job's row has them (what the job's own metadata reports), once it has any."""
    if job.prompt_tokens is None and job.completion_tokens is None:
        return None
    prompt, completion = job.prompt_tokens or 0, job.completion_tokens or 0
    cached = BatchInputTokensDetails(cached_tokens=job.cached_prompt_tokens or 0)
    return BatchUsage(
        input_tokens=prompt, input_tokens_details=cached, output_tokens=completion, total_tokens=prompt + completion
    )


def _bytes_under(directory: str) -> int:
    """The bytes of the files a job's work dir holds (a batch's copy of its input file, before it runs)."""
    fs, root = io.filesystem(directory)
    return int(fs.du(root, total=True)) if fs.exists(root) else 0


def _unix(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None
