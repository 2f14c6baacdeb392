"""The one way a job is made, whoever asks: the API (v1 or v2), a run launched from the launchpad or the
CLI, a schedule's tick. A request is checked once (the priority, what this deployment can serve), its
inline content written to a file in the job's work dir, and the job stored once; the stored request, and
the run config made from it, name that file, so neither grows with the request's size.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable

from pydantic import Field, TypeAdapter, model_validator

from batch_pipeline.admission.capabilities import refusals
from batch_pipeline.contract import CreateBatchCompletionsV1Request, CreateBatchCompletionsV2Request
from batch_pipeline.contract.priority import run_priority
from batch_pipeline.contract.requests import DEFAULT_MAX_RUNTIME_SEC, BatchContent
from batch_pipeline.core import io
from batch_pipeline.core.io import make_private_directory
from batch_pipeline.store.jobs import JobRecord, JobStore, NewJob
from batch_pipeline.tenancy.tenants import team_of_owner

# A job's inline content, as written at submission: a JSON array of records, as an input file holds them.
CONTENT_FILE = "content.json"
_CONTENT = TypeAdapter(BatchContent)


class UnservableRequest(ValueError):
    """A request the contract accepts but this deployment cannot run: `(field, why)` for each part."""

    def __init__(self, refused: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{field}: {why}" for field, why in refused))
        self.refused = refused


class QuotaExceeded(RuntimeError):
    """A submission past one of its team's quotas (the tenants file): nothing is stored. `quota` names it;
    `retry_after_s` is when trying again may help, None when only the operator can."""

    def __init__(self, quota: str, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(f"{quota}: {message}")
        self.quota = quota
        self.retry_after_s = retry_after_s


class StoredRequest(CreateBatchCompletionsV2Request):
    """A v2 request as the job store and the run config hold it: inline content replaced by the file it
    was written to at submission (`content_path`)."""

    content_path: str | None = Field(
        None,
        description="Set by the submission path: the file a request's inline content was written to. "
        "Leave it empty; give content or input_data_path.",
    )

    @model_validator(mode="after")
    def _exactly_one_input(self):  # the v2 rule, with content by reference counted as content
        given = [name for name in ("input_data_path", "content", "content_path") if getattr(self, name) is not None]
        if not given:
            raise ValueError("Either input_data_path or content needs to be provided.")
        if len(given) > 1:
            raise ValueError("Only one of input_data_path and content can be provided.")
        return self


def from_v1(body: CreateBatchCompletionsV1Request) -> CreateBatchCompletionsV2Request:
    """A v1 request as the v2 request it means, field by field: v1's `model_config.labels` are job labels
    (the request's own labels win a clash)."""
    model_config = body.model_cfg
    return CreateBatchCompletionsV2Request.model_validate(
        {
            **body.model_dump(by_alias=True, exclude_none=True, exclude={"model_cfg", "labels", "content"}),
            "content": body.content,
            "model_config": model_config.model_dump(by_alias=True, exclude_none=True, exclude={"labels"}),
            "labels": {**model_config.labels, **body.labels},
        }
    )


def check_servable(request: CreateBatchCompletionsV2Request, owner: str | None, own_dir: str | None = None) -> None:
    """Raise InvalidPriority or UnservableRequest, naming the field, for what this deployment cannot run
    for `owner` (its team's data roots; `own_dir`: the job's work dir, where the service may place the
    job's own files)."""
    run_priority(request.priority)
    if refused := refusals(request, owner, own_dir):
        raise UnservableRequest(refused)


def submit(
    store: JobStore,
    work_dir_of: Callable[[str], str],
    owner: str,
    request: CreateBatchCompletionsV2Request,
    idempotency_key: str | None = None,
    run_id: str | None = None,
    job_id: str | None = None,
    failure_reason: str | None = None,
) -> tuple[JobRecord, bool]:
    """Make a job of a request; with an idempotency key this owner used before, the job made then (or
    IdempotencyConflict). `work_dir_of(job_id)` is where the job's files go; `run_id` registers a job for
    a run that already executes it. The service's own callers may give the job's id and a StoredRequest
    whose content it already wrote in the job's work dir, or store a job that failed before it could run
    (`failure_reason`). Returns the record and whether it was created."""
    job_id = job_id or NewJob.new_id()
    if failure_reason is None:
        check_servable(request, owner, own_dir=work_dir_of(job_id))
        check_queue_quota(store, owner, idempotency_key)
    fields = request.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"content"})
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    content_path = getattr(request, "content_path", None)
    if request.content is not None:
        content_path = io.join(work_dir_of(job_id), CONTENT_FILE)
        content = _CONTENT.dump_json(request.content, by_alias=True, exclude_none=True)
        digest.update(content)
        _write_content(content_path, content)
        fields["content_path"] = content_path
    try:
        record, created = store.create(
            NewJob(
                job_id=job_id,
                owner=owner,
                request_json=json.dumps(fields),
                request_sha256=digest.hexdigest(),
                model=request.model_cfg.model,
                priority=request.priority,
                labels=request.labels,
                max_runtime_sec=request.max_runtime_sec or DEFAULT_MAX_RUNTIME_SEC,
                content_path=content_path,
                idempotency_key=idempotency_key,
                run_id=run_id,
                failure_reason=failure_reason,
            )
        )
    except BaseException:
        _remove(content_path)  # no job, no file
        raise
    if not created:
        _remove(content_path)  # the key's first job has its own copy
    return record, created


# When a team past its queue quota may try again: its jobs start as run slots free.
QUEUE_QUOTA_RETRY_AFTER_S = 30


def check_queue_quota(store: JobStore, owner: str, idempotency_key: str | None = None) -> None:
    """Raise QuotaExceeded when `owner`'s team has `max_queued_jobs` jobs waiting to start already. A retry
    of a submission that made its job (the same Idempotency-Key) is answered with that job, never refused."""
    team = team_of_owner(owner)
    limit = team.config.max_queued_jobs if team is not None else None
    if limit is None:
        return
    if idempotency_key is not None and store.with_idempotency_key(owner, idempotency_key) is not None:
        return
    queued = store.count_queued(owner)
    if queued >= limit:
        raise QuotaExceeded(
            "max_queued_jobs",
            f"your team has {queued} jobs waiting to start, its quota of {limit}; submit again once one has started",
            retry_after_s=QUEUE_QUOTA_RETRY_AFTER_S,
        )


def _remove(path: str | None) -> None:
    if path is None:
        return
    with contextlib.suppress(OSError):  # a file left behind is not worth failing the request over
        io.remove(path)


def _write_content(path: str, content: bytes) -> None:
    directory = path.rsplit("/", 1)[0]
    if io.is_local(path):  # the job's prompts: for the service's user alone
        make_private_directory(directory)
    else:
        io.makedirs(directory)
    with io.atomic_write(path, "wb") as handle:  # read back as an input file is: a list, or one v1 object
        handle.write(content)
