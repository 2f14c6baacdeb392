"""The job store: batch jobs as rows, and their lifecycle (stored, launched, started, ended, cancelled,
resumed) as the API, the sensors and the pipeline move them through it.

A job's status, progress, counts and tokens are data in its row, written as they change, so that a
status read is an indexed query whatever the job's size. SQLite in dagster_home/ by default; any
SQLAlchemy URL (Postgres) in production. The schema is versioned (Alembic, `store/migrations/`) and
upgraded once per process; one engine per process and URL (`store/engine.py`), tables in `store/schema.py`.
The same tables are read and written by a store of each other purpose: shard progress (`progress.py`), run
slots and fair share (`sharing.py`), quotas (`quotas.py`), reports (`reports.py`), retention (`retention.py`).
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any, TypedDict

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from batch_pipeline.store.engine import StoreBase
from batch_pipeline.store.quotas import Admit, TeamFigures, admitting
from batch_pipeline.store.records import JobRecord, NewJob, Page
from batch_pipeline.store.schema import (
    FINISHED,
    JOB_ID_LENGTH,
    JobStatus,
    job_labels,
    jobs,
    label_digest,
)
from batch_pipeline.store.sql import json_scalar, utc, utc_now
from batch_pipeline.store.webhooks import add_end_event


class IdempotencyConflict(ValueError):
    """An idempotency key this owner already used for a different request."""


class JobStore(StoreBase):
    """The jobs' rows at a SQLAlchemy URL (a deployment's: `Settings.job_store_url`)."""

    # --- submission -------------------------------------------------------------------------------------

    def create(self, job: NewJob, admit: Admit | None = None) -> tuple[JobRecord, bool]:
        """Store a new job in one transaction; with an idempotency key already used by this owner, return
        that job instead, or raise IdempotencyConflict if it was used for a different request. The second
        value says whether a job was created. `admit`, given the owner's figures in that transaction, under
        the owner's admission lock (`TeamFigures`), raises to refuse the job (not asked for a retry of a
        made job): no two jobs of one owner are counted against the same figures."""
        now = utc_now()
        row = {
            "job_id": job.job_id,
            "owner": job.owner,
            "idempotency_key": job.idempotency_key,
            "request": job.request_json,
            "request_sha256": job.request_sha256,
            "content_path": job.content_path,
            "content_bytes": job.content_bytes,
            "model": job.model[:256],
            "priority": job.priority,
            "labels": json.dumps(job.labels),
            "created_at": now,
            "expires_at": now + timedelta(seconds=job.max_runtime_sec),
            "run_id": job.run_id,
            "status": JobStatus.QUEUED,
            "estimated_tokens": job.estimated_tokens,
            "request_kind": job.request_kind,
        }
        if job.failure_reason is not None:
            row |= {
                "status": JobStatus.FAILED,
                "failed_at": now,
                "completed_at": now,
                "failure_reason": job.failure_reason,
            }
        try:
            with admitting(self.engine, job.owner) if admit else self.engine.begin() as connection:
                if admit and not (job.idempotency_key and self._has_key(connection, job.owner, job.idempotency_key)):
                    admit(TeamFigures(connection, job.owner))
                connection.execute(jobs.insert().values(**row))
                if job.labels:
                    connection.execute(
                        job_labels.insert(),
                        [
                            {"job_id": job.job_id, "key": key, "value": value, "digest": label_digest(key, value)}
                            for key, value in job.labels.items()
                        ],
                    )
                if job.failure_reason is not None:  # stored ended: its webhook event in the same transaction
                    add_end_event(connection, job.job_id)
        except IntegrityError:
            if job.idempotency_key is None:
                raise
            existing = self._one(sa.and_(jobs.c.owner == job.owner, jobs.c.idempotency_key == job.idempotency_key))
            if existing is None:
                raise
            # Rows stored before the hash was kept have none: they keep the old answer, the first job.
            if existing.request_sha256 is not None and existing.request_sha256 != job.request_sha256:
                raise IdempotencyConflict(
                    f"Idempotency-Key {job.idempotency_key!a} was already used for a different request "
                    f"(job {existing.job_id}); use a new key for a new request"
                ) from None
            return existing, False
        return JobRecord.from_row(_Row(row)), True

    # --- reads ------------------------------------------------------------------------------------------

    def with_idempotency_key(self, owner: str, key: str) -> JobRecord | None:
        return self._one(sa.and_(jobs.c.owner == owner, jobs.c.idempotency_key == key))

    @staticmethod
    def _has_key(connection: sa.Connection, owner: str, key: str) -> bool:
        query = sa.select(jobs.c.job_id).where(jobs.c.owner == owner, jobs.c.idempotency_key == key)
        return connection.execute(query).first() is not None

    def get(self, job_id: str) -> JobRecord | None:
        # Not an id the store makes (longer than its column, a NUL Postgres cannot compare): absent, not an error.
        if len(job_id) > JOB_ID_LENGTH or "\x00" in job_id:
            return None
        return self._one(jobs.c.job_id == job_id)

    def list(
        self,
        owner: str | None = None,
        status: str | None = None,
        labels: dict[str, str] | None = None,
        limit: int = 1000,
        after: str | None = None,
        max_bytes: int | None = None,
    ) -> Page:
        """Jobs newest first, filtered in SQL, one page of `limit`, which ends early once its rows' stored
        requests and labels pass `max_bytes` (the rows are read as they stream, so no more are held);
        `after` is the last job id of the page before (an unknown cursor, or another owner's job, gives an
        empty page)."""
        # No stored label holds a NUL (the contract refuses it), and Postgres cannot compare one.
        if any("\x00" in text for pair in (labels or {}).items() for text in pair):
            return Page([], None)
        query = sa.select(jobs)
        if owner is not None:
            query = query.where(jobs.c.owner == owner)
        if status is not None:
            query = query.where(_reads_as(status))
        for key, value in (labels or {}).items():
            query = query.where(
                sa.exists().where(
                    job_labels.c.job_id == jobs.c.job_id,
                    job_labels.c.digest == label_digest(key, value),
                    job_labels.c.key == key,
                    job_labels.c.value == value,
                )
            )
        if after is not None:
            cursor = self.get(after)
            if cursor is None or (owner is not None and cursor.owner != owner):
                return Page([], None)
            query = query.where(
                sa.or_(
                    jobs.c.created_at < cursor.created_at,
                    sa.and_(jobs.c.created_at == cursor.created_at, jobs.c.job_id < cursor.job_id),
                )
            )
        query = query.order_by(jobs.c.created_at.desc(), jobs.c.job_id.desc()).limit(limit + 1)
        records: builtins.list[JobRecord] = []
        size, more = 0, False
        with self.engine.connect() as connection:
            for row in connection.execution_options(yield_per=50).execute(query):
                if len(records) == limit or (max_bytes is not None and size >= max_bytes):
                    more = True
                    break
                records.append(JobRecord.from_row(row))
                size += len(row.request) + len(row.labels)
        return Page(records, records[-1].job_id if more and records else None)

    def awaiting_launch(self, chunk: int = 200) -> Iterator[builtins.list[JobRecord]]:
        """The queued jobs without a Dagster run, oldest first, a chunk of records at a time (one query
        each): a caller that stops early reads no more."""
        query = (
            sa.select(jobs.c.job_id)
            .where(jobs.c.status == JobStatus.QUEUED, jobs.c.run_id.is_(None))
            .order_by(jobs.c.created_at)
        )
        with self.engine.connect() as connection:
            job_ids = connection.execute(query).scalars().all()
        for start in range(0, len(job_ids), chunk):
            wanted = job_ids[start : start + chunk]
            with self.engine.connect() as connection:
                rows = connection.execute(
                    sa.select(jobs).where(
                        jobs.c.job_id.in_(wanted), jobs.c.status == JobStatus.QUEUED, jobs.c.run_id.is_(None)
                    )
                )
                by_id = {row.job_id: JobRecord.from_row(row) for row in rows}
            yield [by_id[job_id] for job_id in wanted if job_id in by_id]

    def unfinished_with_runs(self) -> builtins.list[tuple[str, str]]:
        """(job id, run id) of every job whose row says a run has it and that has not finished."""
        query = sa.select(jobs.c.job_id, jobs.c.run_id).where(
            jobs.c.status.in_((JobStatus.QUEUED, JobStatus.RUNNING)), jobs.c.run_id.is_not(None)
        )
        with self.engine.connect() as connection:
            return [(row.job_id, row.run_id) for row in connection.execute(query)]

    # --- lifecycle, as the API, the sensors and the pipeline see it --------------------------------------

    def mark_failed(self, job_id: str, reason: str) -> None:
        """A job that cannot become a run: it is never taken again, and reads `failed` with the reason."""
        now = utc_now()
        self._end(
            job_id,
            sa.and_(jobs.c.job_id == job_id, jobs.c.run_id.is_(None), jobs.c.status == JobStatus.QUEUED),
            status=JobStatus.FAILED,
            failed_at=now,
            completed_at=now,
            failure_reason=reason,
        )

    def link_run(self, job_id: str, run_id: str) -> None:
        self._update(jobs.c.job_id == job_id, run_id=run_id)

    def set_priority(self, job_id: str, priority: str | None) -> None:
        self._update(jobs.c.job_id == job_id, priority=priority)

    def cancel_before_launch(self, job_id: str) -> bool:
        """Mark a job cancelled if no run was made for it yet; False when a run already exists."""
        now = utc_now()
        return self._end(
            job_id,
            sa.and_(jobs.c.job_id == job_id, jobs.c.run_id.is_(None), jobs.c.status == JobStatus.QUEUED),
            status=JobStatus.CANCELLED,
            cancelled_at=now,
            completed_at=now,
        )

    def mark_cancelled(self, job_id: str) -> None:
        """The job's run was asked to stop: it reads cancelled once the run has ended (`mark_run_ended`) and its
        finished results are in its output (`JobRecord.stopping`), not before; until then it keeps its status."""
        self._update(
            sa.and_(jobs.c.job_id == job_id, jobs.c.status.not_in(FINISHED), jobs.c.cancelled_at.is_(None)),
            cancelled_at=utc_now(),
        )

    def mark_started(self, job_id: str, run_id: str, started_at: datetime | None = None) -> bool:
        """A run of the job started at `started_at` (its first, a retry, or a re-execution from the UI): it
        is the job's run now, and the job runs. False, and nothing changes, for a job cancelled before any
        run of it started: a run asked for just before the cancel must not run."""
        now = started_at or utc_now()
        with self.engine.begin() as connection:
            row = connection.execute(
                sa.select(
                    jobs.c.created_at,
                    jobs.c.started_at,
                    jobs.c.resumed_at,
                    jobs.c.status,
                    jobs.c.cancelled_at,
                    jobs.c.run_started_at,
                    jobs.c.completed_at,
                    jobs.c.earlier_runs_s,
                ).where(jobs.c.job_id == job_id)
            ).first()
            if row is None:
                return True  # a run with no job behind it (`execute_request` with an id of its own)
            # Cancelled before any run started, or (resumed, its first start kept) before its resume's run did.
            resumed_since_start = (
                row.resumed_at is not None and row.started_at is not None and utc(row.started_at) < utc(row.resumed_at)
            )
            if row.cancelled_at is not None and (row.started_at is None or resumed_since_start):
                return False
            values: dict[str, Any] = {
                "run_id": run_id,
                "status": JobStatus.RUNNING,
                "status_detail": None,
                "completed_at": None,
                "failure_reason": None,
            }
            if row.started_at is None:
                values |= {"started_at": now, "queue_wait_s": (now - utc(row.created_at)).total_seconds()}
            values |= _runs_charged(row, now)
            connection.execute(jobs.update().where(jobs.c.job_id == job_id).values(**values))
        return True

    def mark_retrying(self, job_id: str, run_id: str, reason: str) -> None:
        """The run failed and Dagster retries it: the job still runs, and says why it starts again."""
        self._update(
            sa.and_(jobs.c.job_id == job_id, jobs.c.run_id == run_id), status=JobStatus.RUNNING, status_detail=reason
        )

    def mark_run_ended(
        self,
        job_id: str,
        run_id: str,
        status: str,
        ended_at: datetime,
        reason: str | None = None,
        keeping_partial_results: bool = False,
    ) -> str | None:
        """How the job's run ended, unless a newer run took the job over; returns the id of the webhook event
        its end wrote (None: nothing new ended). `keeping_partial_results`: keep_partial_results is about to
        merge the run's finished results into the output, so the event is held until `record_results`
        records that output (`add_end_event`)."""
        # A job someone cancelled reads cancelled however its run then ended.
        values: dict[str, Any] = {
            "status": sa.case((jobs.c.cancelled_at.is_not(None), JobStatus.CANCELLED), else_=status),
            "completed_at": ended_at,
            "status_detail": None,
        }
        if reason is not None:
            values["failure_reason"] = reason
        # The job's run, or none yet; never the run a resume started the job again from (its end, recorded
        # late, would undo the resume).
        unlinked = sa.and_(
            jobs.c.run_id.is_(None),
            sa.or_(jobs.c.resumed_from_run_id.is_(None), jobs.c.resumed_from_run_id != run_id),
        )
        condition = sa.and_(jobs.c.job_id == job_id, sa.or_(jobs.c.run_id == run_id, unlinked))
        # Not ended since it was last queued: a resumed job keeps its previous end until a run of it starts.
        not_ended = sa.or_(jobs.c.completed_at.is_(None), jobs.c.completed_at < jobs.c.resumed_at)
        with self.engine.begin() as connection:
            # The job's end, with its webhook event in the same transaction; a run's end recorded again (the
            # status sensors and the reconciler) changes the row but announces nothing new.
            ending = connection.execute(
                jobs.update().where(condition, not_ended).values(run_id=run_id, **values)
            ).rowcount
            if ending:
                return add_end_event(connection, job_id, held=keeping_partial_results)
            connection.execute(jobs.update().where(condition).values(run_id=run_id, **values))
            return None

    # --- resume ---------------------------------------------------------------------------------------

    def resume(
        self,
        record: JobRecord,
        resumed_from: str,
        idempotency_key: str | None,
        max_runtime_sec: int,
        admit: Admit | None = None,
    ) -> bool:
        """The stopped job `record` (failed, cancelled or expired, its run's end recorded) queued again, as
        it was read: the jobs sensor gives it a new run (its runs count `resume_count`), which plans the
        same shards and generates only what their checkpoints lack. Its deadline counts again from now.
        False, and nothing changes, when the row changed since it was read (another resume, a late
        status sensor). `admit` may refuse it, as `create`'s does a new job, in the same transaction."""
        now = utc_now()
        same_run = jobs.c.run_id.is_(None) if record.run_id is None else jobs.c.run_id == record.run_id
        condition = sa.and_(
            jobs.c.job_id == record.job_id,
            jobs.c.status == record.status,
            same_run,
            jobs.c.completed_at.is_not(None),
            jobs.c.work_dir_deleted_at.is_(None),  # a cleanup between the caller's read and this write
        )
        queued_again = (
            jobs.update()
            .where(condition)
            .values(
                status=JobStatus.QUEUED,
                run_id=None,
                resume_count=sa.func.coalesce(jobs.c.resume_count, 0) + 1,
                resumed_from=resumed_from,
                resumed_from_run_id=record.run_id,
                resumed_at=now,
                resume_idempotency_key=idempotency_key,
                requests_kept=None,
                prompt_tokens_kept=None,
                completion_tokens_kept=None,
                expires_at=now + timedelta(seconds=max_runtime_sec),
                cancelled_at=None,
                failed_at=None,
                failure_reason=None,
                status_detail=None,
                results=None,
                shard_phase=None,  # its new run's shards say theirs
            )
        )
        with admitting(self.engine, record.owner) if admit else self.engine.begin() as connection:
            if admit:
                admit(TeamFigures(connection, record.owner))
            return connection.execute(queued_again).rowcount > 0

    # --- internals --------------------------------------------------------------------------------------

    def _update(self, condition: Any, **values: Any) -> bool:
        with self.engine.begin() as connection:
            return connection.execute(jobs.update().where(condition).values(**values)).rowcount > 0

    def _end(self, job_id: str, condition: Any, **values: Any) -> bool:
        """`_update` for a change that ends the job, with its webhook event in the same transaction."""
        with self.engine.begin() as connection:
            if connection.execute(jobs.update().where(condition).values(**values)).rowcount == 0:
                return False
            add_end_event(connection, job_id)
            return True

    def _one(self, condition: Any) -> JobRecord | None:
        with self.engine.connect() as connection:
            row = connection.execute(sa.select(jobs).where(condition)).first()
        return JobRecord.from_row(row) if row else None


def _reads_as(status: str) -> Any:
    """The rows of the jobs whose users read `status` (`JobRecord.status_read`): a cancelled job whose run
    planned shards reads running until the results it finished are recorded."""
    stopping = sa.and_(
        jobs.c.status == JobStatus.CANCELLED,
        jobs.c.run_id.is_not(None),
        sa.func.coalesce(jobs.c.requests_total, 0) > 0,
        sa.or_(
            jobs.c.results.is_(None),
            sa.func.coalesce(json_scalar(jobs.c.results, "dagster_run_id"), "") != sa.func.coalesce(jobs.c.run_id, ""),
        ),
    )
    if status == JobStatus.CANCELLED:
        return sa.and_(jobs.c.status == status, sa.not_(stopping))
    if status == JobStatus.RUNNING:
        return sa.or_(jobs.c.status == status, stopping)
    return jobs.c.status == status


class _RunsCharged(TypedDict, total=False):
    """The job row's columns a run's start charges: when the latest run started, and what ran before it."""

    run_started_at: datetime
    earlier_runs_s: float


def _runs_charged(row: Any, started_at: datetime) -> _RunsCharged:
    """A run starting at `started_at`: it is the job's latest, and the one before it (the job's row as read)
    joins the earlier runs, for as long as it ran: to its recorded end, or (not recorded yet) to this start.
    The same run's start marked again changes nothing."""
    previous = utc(row.run_started_at or row.started_at)
    if previous is None:
        return {"run_started_at": started_at}
    if started_at <= previous:
        return {}
    ran = max(0.0, ((utc(row.completed_at) or started_at) - previous).total_seconds())
    return {"run_started_at": started_at, "earlier_runs_s": (row.earlier_runs_s or 0.0) + ran}


class _Row(dict):
    """A row as inserted, read like a database row: the record of a new job without reading it back (and
    parsing a request that may be large)."""

    def __getattr__(self, name: str) -> Any:
        return self.get(name)
