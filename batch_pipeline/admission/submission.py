"""The one way a job is made, whoever asks: the API (v1 or v2), a run launched from the launchpad or the
CLI, a schedule's tick. A request is checked once (the priority, what this deployment can serve), its
inline content written to a file in the job's work dir, and the job stored once; the stored request, and
the run config made from it, name that file, so neither grows with the request's size.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from pydantic import Field, TypeAdapter, model_validator

from batch_pipeline.admission.capabilities import refusals
from batch_pipeline.admission.paths import DataFiles
from batch_pipeline.admission.policy import AdmissionPolicy
from batch_pipeline.contract import CreateBatchCompletionsV1Request, CreateBatchCompletionsV2Request
from batch_pipeline.contract.kinds import CHARS_PER_TOKEN, inline_content_kind
from batch_pipeline.contract.priority import run_priority
from batch_pipeline.contract.requests import DEFAULT_MAX_RUNTIME_SEC, BatchContent
from batch_pipeline.core import io
from batch_pipeline.core.io import make_private_directory
from batch_pipeline.shards.records import work_items
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.openai import OpenAIStore
from batch_pipeline.store.quotas import Admit, QuotaStore, TeamFigures, TokensOfTheDay
from batch_pipeline.store.records import JobRecord, NewJob
from batch_pipeline.store.result_cache import ResultCacheStore
from batch_pipeline.tenancy.tenants import Team

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
    `retry_after_s` is when trying again may help, None when only the operator can; `param`, the request's
    field that takes it past, where one does."""

    def __init__(self, quota: str, message: str, retry_after_s: int | None = None, param: str | None = None) -> None:
        super().__init__(f"{quota}: {message}")
        self.quota = quota
        self.retry_after_s = retry_after_s
        self.param = param


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


def check_servable(
    request: CreateBatchCompletionsV2Request, owner: str | None, policy: AdmissionPolicy, own_dir: str | None = None
) -> None:
    """Raise InvalidPriority or UnservableRequest, naming the field, for what `policy` does not admit of
    `owner`'s request (its team's data roots; `own_dir`: the job's work dir, where the service may place the
    job's own files)."""
    run_priority(request.priority)
    if refused := refusals(request, owner, policy, own_dir):
        raise UnservableRequest(refused)


def submit(
    store: JobStore,
    work_dir_of: Callable[[str], str],
    owner: str,
    request: CreateBatchCompletionsV2Request,
    policy: AdmissionPolicy,
    idempotency_key: str | None = None,
    run_id: str | None = None,
    job_id: str | None = None,
    failure_reason: str | None = None,
    content_bytes: int | None = None,
    request_kind: str | None = None,
) -> tuple[JobRecord, bool]:
    """Make a job of a request that `policy` admits; with an idempotency key this owner used before, the job
    made then (or IdempotencyConflict). `work_dir_of(job_id)` is where the job's files go; `run_id` registers
    a job for a run that already executes it. The service's own callers may give the job's id and a StoredRequest
    whose content it already wrote in the job's work dir (`content_bytes` of it, counted against the team's
    max_stored_bytes as inline content is), or store a job that failed before it could run
    (`failure_reason`), and say the kind of its requests (`request_kind`, an OpenAI batch's endpoint's; inline
    content's is its own, an input file's its plan records). Returns the record and whether it was created."""
    job_id = job_id or NewJob.new_id()
    team = policy.team_of_owner(owner)
    admit: Admit | None = None
    estimate: int | None = None
    if failure_reason is None:
        check_servable(request, owner, policy, own_dir=work_dir_of(job_id))
        # Read before any file is written, to refuse early; the store counts them again as it stores the job.
        check_queue_quota(store, owner, team, idempotency_key)
        check_tokens_quota(store, owner, team, idempotency_key)
        admit = admission_quotas(team)
        if team is not None and team.config.max_tokens_per_day is not None:
            estimate = estimated_tokens(request, policy.data_files(owner, own_dir=work_dir_of(job_id)))
    inline_kind = inline_content_kind(request.content) if request.content is not None else None
    fields = request.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"content"})
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    content_path = getattr(request, "content_path", None)
    content: bytes | None = None
    if request.content is not None:
        content_path = io.join(work_dir_of(job_id), CONTENT_FILE)
        content = _CONTENT.dump_json(request.content, by_alias=True, exclude_none=True)
        digest.update(content)
        fields["content_path"] = content_path
    # The content's bytes are held against the team's max_stored_bytes from before the file is written
    # until the job's row records them (or there is no job).
    held = (
        hold_stored_bytes(store, owner, team, len(content), "this request's inline content", idempotency_key)
        if content is not None and failure_reason is None
        else contextlib.nullcontext()
    )
    with held:
        if content is not None:
            assert content_path is not None
            _write_content(content_path, content)
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
                    content_bytes=len(content) if content is not None else content_bytes,
                    idempotency_key=idempotency_key,
                    run_id=run_id,
                    failure_reason=failure_reason,
                    estimated_tokens=estimate,
                    request_kind=request_kind or inline_kind,
                ),
                admit,
            )
        except BaseException:
            _remove(content_path)  # no job, no file
            raise
    if not created:
        _remove(content_path)  # the key's first job has its own copy
    return record, created


# When a team past its queue quota may try again: its jobs start as run slots free.
QUEUE_QUOTA_RETRY_AFTER_S = 30


def check_queue_quota(store: JobStore, owner: str, team: Team | None, idempotency_key: str | None = None) -> None:
    """Raise QuotaExceeded when `owner`'s `team` (None: not a team's job) has `max_queued_jobs` jobs waiting to
    start already: for a new job, or a stopped one resumed (queued again). A retry of a submission that made
    its job (the same Idempotency-Key) is answered with that job, never refused. A read ahead of the job's
    store, to refuse before any file is written: `admission_quotas` is the count that holds."""
    limit = team.config.max_queued_jobs if team is not None else None
    if limit is None or _retry_of_a_made_job(store, owner, idempotency_key):
        return
    if refused := _queue_refusal(QuotaStore(engine=store.engine).count_queued(owner), limit):
        raise refused


def _queue_refusal(queued: int, limit: int) -> QuotaExceeded | None:
    if queued < limit:
        return None
    return QuotaExceeded(
        "max_queued_jobs",
        f"your team has {queued} jobs waiting to start, its quota of {limit}; try again once one has started",
        retry_after_s=QUEUE_QUOTA_RETRY_AFTER_S,
    )


def _retry_of_a_made_job(store: JobStore, owner: str, idempotency_key: str | None) -> bool:
    return idempotency_key is not None and store.with_idempotency_key(owner, idempotency_key) is not None


def check_tokens_quota(
    store: JobStore, owner: str, team: Team | None, idempotency_key: str | None = None, now: datetime | None = None
) -> None:
    """Raise QuotaExceeded when the tokens of `owner`'s `team`'s jobs today (UTC) reach its `max_tokens_per_day`
    (QuotaStore.tokens_held_since: the prompt and completion tokens of its jobs that ended today, and of each
    job not yet ended the larger of its estimate and what it has used so far); Retry-After is the next UTC
    midnight. A running job finishes; jobs already waiting are held by the jobs sensor (pipeline/run_slots.py)
    once what the team's jobs used reaches it. A retry of a submission that made its job is answered with it.
    A read ahead of the job's store, as `check_queue_quota` is."""
    limit = team.config.max_tokens_per_day if team is not None else None
    if limit is None or _retry_of_a_made_job(store, owner, idempotency_key):
        return
    now = now or datetime.now(UTC)
    if refused := _tokens_refusal(
        QuotaStore(engine=store.engine).tokens_held_since(owner, _utc_midnight(now)), limit, now
    ):
        raise refused


def _utc_midnight(now: datetime) -> datetime:
    return now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def _tokens_refusal(tokens: TokensOfTheDay, limit: int, now: datetime) -> QuotaExceeded | None:
    if tokens.held < limit:
        return None
    until_tomorrow = (_utc_midnight(now) + timedelta(days=1) - now).total_seconds()
    reserved = (
        f", and its jobs not yet ended hold {tokens.reserved} more by their estimates ({tokens.held}/{limit})"
        if tokens.reserved
        else ""
    )
    return QuotaExceeded(
        "max_tokens_per_day",
        f"your team's jobs have used {tokens.used}/{limit} tokens (prompt plus completion) today, UTC{reserved}, "
        f"its quota of {limit} a day; submit again after 00:00 UTC, when the day's count starts over",
        retry_after_s=max(1, math.ceil(until_tomorrow)),
    )


def admission_quotas(team: Team | None, tokens: bool = True) -> Admit | None:
    """`team`'s `max_queued_jobs` and (with `tokens`) `max_tokens_per_day` as the job store counts them in the
    transaction that stores a job, under the team's admission lock (`JobStore.create`, `resume`): concurrent
    submissions are counted one after the other, each against the jobs the ones before it stored. None where
    the team sets neither."""
    queued_limit = team.config.max_queued_jobs if team is not None else None
    tokens_limit = team.config.max_tokens_per_day if team is not None and tokens else None
    if queued_limit is None and tokens_limit is None:
        return None

    def admit(figures: TeamFigures) -> None:
        if queued_limit is not None and (refused := _queue_refusal(figures.queued(), queued_limit)):
            raise refused
        if tokens_limit is not None:
            now = datetime.now(UTC)
            if refused := _tokens_refusal(figures.tokens_since(_utc_midnight(now)), tokens_limit, now):
                raise refused

    return admit


def estimated_tokens(request: CreateBatchCompletionsV2Request, files: DataFiles) -> int:
    """The prompt and completion tokens a job of `request` is estimated to use, reserved against its team's
    max_tokens_per_day until it ends: inline content as its shard plan estimates it (`shards.records`: each
    prompt's characters at 4 a token, plus its output limit); a request naming its input by file, the file's
    size at 4 bytes a token, unread (reading it could take as long as the job's planning does)."""
    if request.content is not None:
        content = _CONTENT.dump_python(request.content, mode="json", by_alias=True, exclude_none=True)
        records = (
            [("content", content)]
            if isinstance(content, dict)
            else [(f"content.{position}", record) for position, record in enumerate(content)]
        )
        try:
            return sum(size.tokens for _, size in work_items(records))
        except ValueError:  # a record its job refuses: it fails before it uses any
            return 0
    path = getattr(request, "content_path", None) or request.input_data_path
    return _file_size(path, files) // CHARS_PER_TOKEN + 1 if path else 0


def _file_size(path: str, files: DataFiles) -> int:
    """The size of a regular file at `path` as the job would open it (0 if none): stat, never opened (a FIFO
    would block), never through a symlink out of its data root."""
    try:
        if not io.is_local(path):
            return io.size(path)
        found = files.beneath(path)
        real = os.path.realpath(path if found is None else os.path.join(*found))
        if found is not None and os.path.commonpath([real, found[0]]) != found[0]:
            return 0
        status = os.stat(real)
    except Exception:  # an object store's errors are not all OSErrors; the job's run names them
        return 0
    return status.st_size if stat.S_ISREG(status.st_mode) else 0


@dataclass(frozen=True)
class StoredBytes:
    """A team's stored bytes against its `max_stored_bytes`: its OpenAI files (uploads and its batches'
    output and error files; deleted ones no longer count), its jobs' inline content and checkpoints (until
    retention deletes their work dirs), and what this process is storing for it at the moment."""

    stored: int
    limit: int

    @property
    def room(self) -> int:
        return max(0, self.limit - self.stored)

    def refusal(self, adding: int, what: str, at_least: bool = False) -> QuotaExceeded:
        size = f"{'at least ' if at_least else ''}{adding} bytes"
        return QuotaExceeded(
            "max_stored_bytes",
            f"your team stores {self.stored} bytes (OpenAI files, jobs' inline content and checkpoints, its result "
            f"cache), its quota of {self.limit}; {what} of {size} would take it past; delete files it no longer needs "
            "(DELETE /v1/files/{file_id}) or empty its result cache (DELETE /v2/result-cache) to make room, or name "
            "the prompts by input_data_path",
        )


class _StoredBytesLedger:
    """The bytes each team is storing in this process now (a file being copied, a content being written),
    held from the quota check until the store's row records them: two uploads at once are checked against
    each other, not both against the bytes stored before them. Per process: each API replica holds its own
    (see docs/operations/tenants.md, Sharing between teams)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._team_locks: dict[str, threading.Lock] = {}
        self._held: dict[str, int] = {}

    def _team_lock(self, owner: str) -> threading.Lock:
        with self._lock:
            return self._team_locks.setdefault(owner, threading.Lock())

    def _stored(self, store: JobStore, owner: str, limit: int) -> StoredBytes:
        files = OpenAIStore(engine=store.engine).file_bytes_of(owner)
        work_dirs = QuotaStore(engine=store.engine).work_dir_bytes_of(owner)
        cached = ResultCacheStore(engine=store.engine).payload_bytes_of(owner)
        return StoredBytes(files + work_dirs + cached + self._held.get(owner, 0), limit)

    def of(self, store: JobStore, owner: str, limit: int | None) -> StoredBytes | None:
        if limit is None:
            return None
        with self._team_lock(owner):
            return self._stored(store, owner, limit)

    @contextlib.contextmanager
    def hold(
        self, store: JobStore, owner: str, limit: int | None, size: int, what: str, idempotency_key: str | None
    ) -> Iterator[None]:
        if limit is None or _retry_of_a_made_job(store, owner, idempotency_key):
            yield
            return
        with self._team_lock(owner):
            stored = self._stored(store, owner, limit)
            if stored.stored + size > limit:
                raise stored.refusal(size, what)
            self._held[owner] = self._held.get(owner, 0) + size
        try:
            yield
        finally:
            with self._team_lock(owner):
                self._held[owner] -= size
                if not self._held[owner]:
                    del self._held[owner]


def _stored_bytes_limit(team: Team | None) -> int | None:
    return team.config.max_stored_bytes if team is not None else None


_stored_bytes = _StoredBytesLedger()


def stored_bytes_of(store: JobStore, owner: str, team: Team | None) -> StoredBytes | None:
    """`owner`'s `team`'s stored bytes and quota (None without a max_stored_bytes)."""
    return _stored_bytes.of(store, owner, _stored_bytes_limit(team))


def hold_stored_bytes(
    store: JobStore, owner: str, team: Team | None, size: int, what: str, idempotency_key: str | None = None
) -> contextlib.AbstractContextManager[None]:
    """Hold `size` more bytes against `owner`'s `team`'s max_stored_bytes while they are written and their
    row stored (enter before writing, leave once the row exists or nothing was kept); QuotaExceeded, with
    nothing held, when they would take the team past it. `what` names them in the refusal."""
    return _stored_bytes.hold(store, owner, _stored_bytes_limit(team), size, what, idempotency_key)


def _remove(path: str | None) -> None:
    """Remove a content file written at submission, and its job's work dir if that is left empty."""
    if path is None:
        return
    with contextlib.suppress(OSError):  # a file left behind is not worth failing the request over
        io.remove(path)
        if io.is_local(path):
            os.rmdir(os.path.dirname(path))  # not empty: a directory the job's caller made and keeps


def _write_content(path: str, content: bytes) -> None:
    directory = path.rsplit("/", 1)[0]
    if io.is_local(path):  # the job's prompts: for the service's user alone
        make_private_directory(directory)
    else:
        io.makedirs(directory)
    with io.atomic_write(path, "wb") as handle:  # read back as an input file is: a list, or one v1 object
        handle.write(content)
