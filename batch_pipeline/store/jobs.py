"""The job store: batch jobs as rows, shared by the API (which stores requests and reads status), the
sensors (which launch runs and record how they ended) and the pipeline (which records progress).

A job's status, progress, counts and tokens are data in its row, written as they change, so that a
status read is an indexed query whatever the job's size. SQLite in dagster_home/ by default; any
SQLAlchemy URL (Postgres) in production. The schema is versioned (Alembic, `store/migrations/`) and
upgraded once per process; one engine per process and URL (`store/engine.py`), tables in `store/schema.py`.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from batch_pipeline.store.engine import engine_for, store_url
from batch_pipeline.store.results import CompletedFigures, JobResults
from batch_pipeline.store.schema import (
    FINISHED,
    JOB_ID_LENGTH,
    JobStatus,
    job_labels,
    job_shards,
    jobs,
    label_digest,
    team_usage,
)
from batch_pipeline.store.sql import json_scalar, owner_bucket, seconds_between, utc, utc_day, utc_now
from batch_pipeline.store.webhooks import add_end_event, release_held_event

_SHARD_FIGURES = ("requests_done", "errors", "prompt_tokens", "completion_tokens")
# What a team stores of a job's work dir: the inline content written at submission, and its checkpoints.
_WORK_DIR_BYTES = sa.func.coalesce(jobs.c.content_bytes, 0) + sa.func.coalesce(jobs.c.checkpoint_bytes, 0)
_FIGURES = ("requests_done", "prompt_tokens", "completion_tokens")  # what usage and /metrics sum


class IdempotencyConflict(ValueError):
    """An idempotency key this owner already used for a different request."""


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

    @staticmethod
    def new_id() -> str:
        return f"batch-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class SlotUse:
    """A job's hold on run slots: from `started_at` to its end (None: still running), over `shards` shards
    (0 before they are planned), each sized by what its launcher gave its worker or, for the shards of
    which the launcher has not said (`shards - charged_shards`), by its stored request's hardware.

    `started_at` is its latest run's start less `earlier_runs_s`, the seconds its earlier runs ran: a
    resumed job holds slots for as long as its runs ran, not through the time it sat stopped between them
    (its earlier runs are counted as if just before its latest, which decays them no more than they were)."""

    owner: str
    started_at: datetime
    ended_at: datetime | None
    shards: int
    request_json: str = field(repr=False)
    job_id: str = ""
    counted_until: datetime | None = None  # the end up to which its team's `team_usage` counts it
    charged_shards: int = 0
    charged_units: float = 0.0  # the sum of what the launcher gave those shards
    earlier_runs_s: float = 0.0


@dataclass(frozen=True)
class WorkByDay:
    """Jobs' work summed for an owner (None: every owner not named) and a UTC day ("YYYY-MM-DD"), for one
    hardware shape: the `gpus` and `cpus` their stored requests ask for (None: not given), as the database
    reads them from the JSON (a number or a string). `shard_seconds` are of the shards of which the launcher
    has not said what it gave them (sized by that shape); `charged_seconds` of the others, already times
    what each was given."""

    owner: str | None
    day: str
    gpus: Any
    cpus: Any
    requests_done: int
    prompt_tokens: int
    completion_tokens: int
    shard_seconds: float
    charged_seconds: float = 0.0


@dataclass(frozen=True)
class TokensOfTheDay:
    """An owner's tokens of a day: `used`, the prompt and completion tokens of its jobs that ended in it and
    what its jobs not yet ended have used so far; `reserved`, what those not yet ended are estimated to use
    past that (`estimated_tokens`). `held`, both, is what its `max_tokens_per_day` is counted against."""

    used: int
    reserved: int

    @property
    def held(self) -> int:
        return self.used + self.reserved


class TeamFigures:
    """An owner's figures as admission counts them, read in the transaction that holds its admission lock
    (`JobStore.create`'s or `resume`'s `admit`), so that the job it admits is counted by the next."""

    def __init__(self, connection: sa.Connection, owner: str) -> None:
        self._connection = connection
        self.owner = owner

    def queued(self) -> int:
        return _count_queued(self._connection, self.owner)

    def tokens_since(self, since: datetime) -> TokensOfTheDay:
        return _tokens_held_since(self._connection, self.owner, since)


Admit = Callable[[TeamFigures], None]
# Postgres: the admission lock's class (the first key of pg_advisory_xact_lock); the second is the owner's hash.
_ADMISSION_LOCK_CLASS = 0x62617463  # "batc"


@dataclass(frozen=True)
class Page:
    jobs: list[JobRecord]
    next_after: str | None  # the cursor of the next page; None on the last one


class JobStore:
    """The jobs' rows at `store_url(url)`: a SQLAlchemy URL, or where none is given, SQLite in $DAGSTER_HOME."""

    def __init__(self, url: str | None = None) -> None:
        self.engine = engine_for(store_url(url))

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
        }
        if job.failure_reason is not None:
            row |= {
                "status": JobStatus.FAILED,
                "failed_at": now,
                "completed_at": now,
                "failure_reason": job.failure_reason,
            }
        try:
            with self._admitting(job.owner) if admit else self.engine.begin() as connection:
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

    def slot_usage_since(self, since: datetime) -> builtins.list[SlotUse]:
        """Each job that held run slots since `since` (running, or ended after it): what fair share counts."""
        return self._slot_uses(
            sa.and_(jobs.c.started_at.is_not(None), sa.or_(jobs.c.completed_at.is_(None), jobs.c.completed_at >= since))
        )

    def slot_holders(self) -> dict[str, int]:
        """How many jobs of each owner hold a run slot: running, or given a run that has not started yet."""
        holding = sa.or_(
            jobs.c.status == JobStatus.RUNNING, sa.and_(jobs.c.status == JobStatus.QUEUED, jobs.c.run_id.is_not(None))
        )
        query = sa.select(jobs.c.owner, sa.func.count()).where(holding).group_by(jobs.c.owner)
        with self.engine.connect() as connection:
            return {owner: int(count) for owner, count in connection.execute(query)}

    # Fair share's reads each tick (every one served by an index), and its one write: each team's usage of
    # its ended jobs is kept in `team_usage`, and each job counted there once, as it ends.

    def waiting_for_admission(self) -> Iterator[tuple[str, str, str | None, object]]:
        """(job id, owner, priority as stored, created) of each queued job without a run, oldest first (then
        by job id): what admission reads of them, from the `ix_batch_jobs_waiting` index alone. `created` is
        the time as the database returns it, not parsed (a third of the read's cost on SQLite, where it is
        text): only equal for jobs created at the same instant, as the order says the rest."""
        created = sa.type_coerce(jobs.c.created_at, sa.String)
        query = (
            sa.select(jobs.c.job_id, jobs.c.owner, jobs.c.priority, created)
            .where(jobs.c.status == JobStatus.QUEUED, jobs.c.run_id.is_(None))
            .order_by(jobs.c.created_at, jobs.c.job_id)
        )
        with self.engine.connect() as connection:
            rows = connection.execute(query).all()
        return iter(rows)  # type: ignore[arg-type]  # Row[...] of these four columns

    def expired_waiting(self, now: datetime) -> builtins.list[tuple[str, str, datetime]]:
        """(job id, owner, deadline) of each queued job without a run whose deadline passed."""
        query = sa.select(jobs.c.job_id, jobs.c.owner, jobs.c.expires_at).where(
            jobs.c.status == JobStatus.QUEUED, jobs.c.run_id.is_(None), jobs.c.expires_at <= now
        )
        with self.engine.connect() as connection:
            return [(job_id, owner, utc(expires)) for job_id, owner, expires in connection.execute(query)]

    def waiting_records(self, job_ids: Iterable[str]) -> builtins.list[JobRecord]:
        """The records of those of these jobs still queued without a run, in the order asked."""
        wanted = list(job_ids)
        if not wanted:
            return []
        query = sa.select(jobs).where(
            jobs.c.job_id.in_(wanted), jobs.c.status == JobStatus.QUEUED, jobs.c.run_id.is_(None)
        )
        with self.engine.connect() as connection:
            by_id = {row.job_id: JobRecord.from_row(row) for row in connection.execute(query)}
        return [by_id[job_id] for job_id in wanted if job_id in by_id]

    def _slot_uses(self, condition: Any) -> builtins.list[SlotUse]:
        of_job = job_shards.c.job_id == jobs.c.job_id
        shards = sa.select(sa.func.count()).where(of_job).scalar_subquery()
        charged = job_shards.c.charged_units.is_not(None)
        charged_shards = sa.select(sa.func.count()).where(of_job, charged).scalar_subquery()
        charged_units = sa.select(sa.func.coalesce(sa.func.sum(job_shards.c.charged_units), 0.0)).where(of_job)
        query = sa.select(
            jobs.c.job_id, jobs.c.owner, jobs.c.started_at, jobs.c.run_started_at, jobs.c.earlier_runs_s,
            jobs.c.completed_at, jobs.c.request, shards, jobs.c.usage_counted_until, charged_shards,
            charged_units.scalar_subquery(),
        ).where(condition)  # fmt: skip
        with self.engine.connect() as connection:
            return [
                SlotUse(
                    row.owner,
                    utc(row.run_started_at or row.started_at) - timedelta(seconds=row.earlier_runs_s or 0.0),
                    utc(row.completed_at),
                    int(row[7] or 0),
                    row.request,
                    row.job_id,
                    utc(row.usage_counted_until),
                    int(row[9] or 0),
                    float(row[10] or 0.0),
                    float(row.earlier_runs_s or 0.0),
                )
                for row in connection.execute(query)
            ]

    def slot_usage_uncounted(self, since: datetime) -> builtins.list[SlotUse]:
        """The jobs that held run slots, ended at or after `since`, and are not counted in their team's
        usage yet."""
        return self._slot_uses(
            sa.and_(jobs.c.usage_counted_until.is_(None), jobs.c.completed_at >= since, jobs.c.started_at.is_not(None))
        )

    def slot_usage_running(self) -> builtins.list[SlotUse]:
        """The jobs holding run slots now (started, not ended); one run again after it ended (a retry or a
        re-execution) has the end its team's usage counted it up to."""
        return self._slot_uses(sa.and_(jobs.c.completed_at.is_(None), jobs.c.started_at.is_not(None)))

    def team_usage(self) -> dict[str, tuple[float, datetime]]:
        """Each team's usage row: its ended jobs' decayed slot-seconds, as they count at the time given."""
        with self.engine.connect() as connection:
            rows = connection.execute(sa.select(team_usage.c.owner, team_usage.c.usage, team_usage.c.as_of))
            return {owner: (float(usage), utc(as_of)) for owner, usage, as_of in rows}

    def count_slot_usage(
        self,
        usage: dict[str, tuple[float, datetime]],
        counted: Iterable[str],
        uncounted: Iterable[str],
        since: datetime,
    ) -> bool:
        """In one transaction: the teams' usage rows set to `usage`, the `counted` jobs (ended) marked as
        counted up to their end, the `uncounted` ones (running again) unmarked, and every job that ended
        without holding slots, or before `since`, marked as counted with nothing. False, and nothing
        written, where another writer counted or changed one of those jobs since they were read."""
        counted, uncounted = list(counted), list(uncounted)
        try:
            with self.engine.begin() as connection:
                self._count_slot_usage(connection, usage, counted, uncounted, since)
        except _Recounted:
            return False
        return True

    @staticmethod
    def _count_slot_usage(
        connection: sa.Connection,
        usage: dict[str, tuple[float, datetime]],
        counted: builtins.list[str],
        uncounted: builtins.list[str],
        since: datetime,
    ) -> None:
        connection.execute(
            jobs.update()
            .where(
                jobs.c.usage_counted_until.is_(None),
                jobs.c.completed_at.is_not(None),
                sa.or_(jobs.c.started_at.is_(None), jobs.c.completed_at < since),
            )
            .values(usage_counted_until=jobs.c.completed_at)
        )
        changed = 0
        for start in range(0, len(counted), 500):
            changed += connection.execute(
                jobs.update()
                .where(
                    jobs.c.job_id.in_(counted[start : start + 500]),
                    jobs.c.usage_counted_until.is_(None),
                    jobs.c.completed_at.is_not(None),
                )
                .values(usage_counted_until=jobs.c.completed_at)
            ).rowcount
        for start in range(0, len(uncounted), 500):
            changed += connection.execute(
                jobs.update()
                .where(
                    jobs.c.job_id.in_(uncounted[start : start + 500]),
                    jobs.c.usage_counted_until.is_not(None),
                    jobs.c.completed_at.is_(None),
                )
                .values(usage_counted_until=None)
            ).rowcount
        if changed != len(counted) + len(uncounted):
            raise _Recounted
        for owner, (value, as_of) in usage.items():
            row = {"usage": value, "as_of": as_of}
            if not connection.execute(team_usage.update().where(team_usage.c.owner == owner).values(**row)).rowcount:
                connection.execute(team_usage.insert().values(owner=owner, **row))

    def count_queued(self, owner: str) -> int:
        """How many of `owner`'s jobs wait to start (queued, with or without a run yet)."""
        with self.engine.connect() as connection:
            return _count_queued(connection, owner)

    def tokens_held_since(self, owner: str, since: datetime) -> TokensOfTheDay:
        """`owner`'s tokens since `since` as its max_tokens_per_day counts them (`TokensOfTheDay`): those of
        its jobs that ended since, and of each not yet ended (waiting, running, or resumed and waiting again)
        the larger of its estimate and what it has used so far."""
        with self.engine.connect() as connection:
            return _tokens_held_since(connection, owner, since)

    def hold_planned_tokens(
        self, job_id: str, owner: str, tokens: int, limit: int, since: datetime
    ) -> TokensOfTheDay | None:
        """The job's reservation made its planned shards' `tokens`, under its owner's admission lock, unless
        the owner's other jobs already hold its `limit` of the day since `since`: then nothing changes, and
        their figures are returned. A file's estimate at submission is its size, unread; a file can grow
        before its job reads it: what the plan read is what counts."""
        with self._admitting(owner) as connection:
            others = _tokens_held_since(connection, owner, since, excluding=job_id)
            if others.held >= limit:
                return others
            connection.execute(jobs.update().where(jobs.c.job_id == job_id).values(estimated_tokens=tokens))
        return None

    @contextlib.contextmanager
    def _admitting(self, owner: str) -> Iterator[sa.Connection]:
        """A transaction that holds `owner`'s admission lock from before its first read to its commit: on
        Postgres an advisory lock of the owner's; on SQLite the database's write lock (BEGIN IMMEDIATE), taken
        before the count, so that a second writer waits for it rather than count what the first is adding."""
        with self.engine.connect() as connection, connection.begin():
            if connection.dialect.name == "sqlite":
                connection.exec_driver_sql("BEGIN IMMEDIATE")
            elif connection.dialect.name == "postgresql":
                connection.execute(
                    sa.text("SELECT pg_advisory_xact_lock(:lock_class, hashtext(:owner))"),
                    {"lock_class": _ADMISSION_LOCK_CLASS, "owner": owner},
                )
            else:
                raise NotImplementedError(f"no admission lock for a {connection.dialect.name} job store")
            yield connection

    @staticmethod
    def _has_key(connection: sa.Connection, owner: str, key: str) -> bool:
        query = sa.select(jobs.c.job_id).where(jobs.c.owner == owner, jobs.c.idempotency_key == key)
        return connection.execute(query).first() is not None

    def work_dir_bytes_of(self, owner: str) -> int:
        """The bytes `owner`'s jobs store in their work dirs: inline content and checkpoints, until retention
        deletes them (jobs of older releases, which did not record them, count none)."""
        query = sa.select(sa.func.coalesce(sa.func.sum(_WORK_DIR_BYTES), 0)).where(jobs.c.owner == owner)
        with self.engine.connect() as connection:
            return int(connection.execute(query).scalar_one())

    def tokens_since(self, owner: str, since: datetime) -> int:
        """Prompt plus completion tokens of `owner`'s jobs that ended at or after `since`, and of those still
        running: a job's figures are totals, counted on the day it ends (today while it runs)."""
        ran = sa.or_(
            jobs.c.completed_at >= since, sa.and_(jobs.c.completed_at.is_(None), jobs.c.started_at.is_not(None))
        )
        tokens = sa.func.coalesce(jobs.c.prompt_tokens, 0) + sa.func.coalesce(jobs.c.completion_tokens, 0)
        query = sa.select(sa.func.coalesce(sa.func.sum(tokens), 0)).where(jobs.c.owner == owner, ran)
        with self.engine.connect() as connection:
            return int(connection.execute(query).scalar_one())

    def tokens_since_by_owner(self, owners: Collection[str], since: datetime) -> dict[str, int]:
        """`tokens_since` of each of these owners, in one grouped query (admission's read each tick; an
        owner with no such job is absent): the ended jobs from `ix_batch_jobs_owner_completed`, the running
        ones from `ix_batch_jobs_holding`, so that no waiting job is read."""
        wanted = list(owners)
        if not wanted:
            return {}
        tokens = sa.func.coalesce(jobs.c.prompt_tokens, 0) + sa.func.coalesce(jobs.c.completion_tokens, 0)
        ended = sa.select(jobs.c.owner, tokens.label("tokens")).where(
            jobs.c.owner.in_(wanted), jobs.c.completed_at >= since
        )
        running = sa.select(jobs.c.owner, tokens.label("tokens")).where(
            jobs.c.completed_at.is_(None), jobs.c.started_at.is_not(None), jobs.c.owner.in_(wanted)
        )
        both = sa.union_all(ended, running).subquery()
        query = sa.select(both.c.owner, sa.func.sum(both.c.tokens)).group_by(both.c.owner)
        with self.engine.connect() as connection:
            return {owner: int(total or 0) for owner, total in connection.execute(query)}

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

    def completed_figures(self, model: str, limit: int = 20) -> builtins.list[CompletedFigures]:
        """The newest `limit` completed jobs of a model, newest first: each one's `results` (its
        completion_tokens, completion_tokens_per_s, wall_s, num_requests, ...) with `shards`, the shard
        workers it ran in. Every owner's jobs: throughput is the deployment's, and no job is named."""
        shards = (
            sa.select(sa.func.count()).where(job_shards.c.job_id == jobs.c.job_id).correlate(jobs).scalar_subquery()
        )
        # created_at, not completed_at: the (status, created_at) index serves the order.
        query = (
            sa.select(jobs.c.results, shards.label("shards"))
            .where(jobs.c.status == JobStatus.COMPLETED, jobs.c.model == model[:256], jobs.c.results.is_not(None))
            .order_by(jobs.c.created_at.desc())
            .limit(limit)
        )
        with self.engine.connect() as connection:
            return [
                CompletedFigures(results=JobResults.from_column(row.results), shards=row.shards)
                for row in connection.execute(query)
            ]

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

    def record_shard_charge(self, job_id: str, shard_index: int, units: float | None) -> None:
        """What the launcher gave the shard's worker (its cores, a pod's limits), as the shard starts: the unit
        of its slot-seconds in fair share and usage from then on. None: the launcher cannot say; the shard
        is charged what its request asks, at least one slot."""
        with self.engine.begin() as connection:
            connection.execute(
                job_shards.update()
                .where(job_shards.c.job_id == job_id, job_shards.c.shard_index == shard_index)
                .values(charged_units=units)
            )

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

    def record_results(self, job_id: str, run_id: str, results: JobResults, held_event: str | None = None) -> None:
        """The summary of what the job's run wrote (its output's metadata, or the partial results of a
        stopped run), with the counts it gives. `held_event`: the job's end event, held until its output is
        final, released in the same transaction (`release_held_event`)."""
        values: dict[str, str | int] = {"results": results.to_column(), **results.row_counts()}
        with self.engine.begin() as connection:
            connection.execute(jobs.update().where(jobs.c.job_id == job_id, jobs.c.run_id == run_id).values(**values))
            if held_event is not None:
                release_held_event(connection, held_event)

    def record_shards(
        self,
        job_id: str,
        requests_per_shard: dict[int, int],
        checkpoint_bytes: dict[int, int] | None = None,
        shard_plan: str | None = None,
    ) -> None:
        """The job's shards as planned (again, on a retry): progress is counted against these totals, and
        `checkpoint_bytes` are what each shard's checkpoint holds already (a resumed job's). `shard_plan`
        is kept from the first run that records one: every later run of the job plans from it."""
        checkpoint_bytes = checkpoint_bytes or {}
        with self.engine.begin() as connection:
            connection.execute(job_shards.delete().where(job_shards.c.job_id == job_id))
            connection.execute(
                job_shards.insert(),
                [
                    {
                        "job_id": job_id,
                        "shard_index": index,
                        "requests_total": total,
                        "checkpoint_bytes": checkpoint_bytes.get(index, 0),
                        "updated_at": utc_now(),
                    }
                    for index, total in requests_per_shard.items()
                ],
            )
            if shard_plan is not None:
                first = sa.and_(jobs.c.job_id == job_id, jobs.c.shard_plan.is_(None))
                connection.execute(jobs.update().where(first).values(shard_plan=shard_plan))
            self._total_shards(connection, job_id)

    def record_checkpoint_bytes(self, job_id: str, shard_index: int, checkpoint_bytes: int) -> None:
        """What a shard's checkpoint holds as one of its attempts ended, and the job's total with it."""
        with self.engine.begin() as connection:
            connection.execute(
                job_shards.update()
                .where(job_shards.c.job_id == job_id, job_shards.c.shard_index == shard_index)
                .values(checkpoint_bytes=checkpoint_bytes, updated_at=utc_now())
            )
            self._total_shards(connection, job_id)

    def record_shard_progress(self, job_id: str, shard_index: int, figures: dict[str, int]) -> None:
        """A shard worker's latest counts (absolute, not increments), and the job's totals with them."""
        values = {name: int(figures[name]) for name in _SHARD_FIGURES if name in figures}
        with self.engine.begin() as connection:
            connection.execute(
                job_shards.update()
                .where(job_shards.c.job_id == job_id, job_shards.c.shard_index == shard_index)
                .values(**values, updated_at=utc_now())
            )
            self._total_shards(connection, job_id)

    @staticmethod
    def _total_shards(connection: sa.Connection, job_id: str) -> None:
        def total(name: str) -> Any:
            return (
                sa.select(sa.func.coalesce(sa.func.sum(job_shards.c[name]), 0))
                .where(job_shards.c.job_id == job_id)
                .scalar_subquery()
            )

        connection.execute(
            jobs.update()
            .where(jobs.c.job_id == job_id)
            .values(
                requests_total=total("requests_total"),
                # Not once retention deleted the work dir: nothing is stored any more.
                checkpoint_bytes=sa.case((jobs.c.work_dir_deleted_at.is_(None), total("checkpoint_bytes")), else_=0),
                **{name: total(name) for name in _SHARD_FIGURES},
            )
        )

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
            )
        )
        with self._admitting(record.owner) if admit else self.engine.begin() as connection:
            if admit:
                admit(TeamFigures(connection, record.owner))
            return connection.execute(queued_again).rowcount > 0

    def record_kept(self, job_id: str, requests: int, prompt_tokens: int, completion_tokens: int) -> bool:
        """What a resumed job's checkpoints held when its resume's first run planned its shards: kept, never
        generated again. Counted once a resume: a retry of that run finds it set and keeps it."""
        return self._update(
            sa.and_(jobs.c.job_id == job_id, jobs.c.resume_count.is_not(None), jobs.c.requests_kept.is_(None)),
            requests_kept=requests,
            prompt_tokens_kept=prompt_tokens,
            completion_tokens_kept=completion_tokens,
        )

    # --- figures for /metrics ---------------------------------------------------------------------------

    def counts_by_status_and_model(self) -> builtins.list[tuple[str, str, int, int, int]]:
        """(status, model, jobs, requests done, completion tokens) over every job."""
        query = sa.select(
            jobs.c.status,
            sa.func.coalesce(jobs.c.model, ""),
            sa.func.count(),
            sa.func.coalesce(sa.func.sum(jobs.c.requests_done), 0),
            sa.func.coalesce(sa.func.sum(jobs.c.completion_tokens), 0),
        ).group_by(jobs.c.status, jobs.c.model)
        with self.engine.connect() as connection:
            return [tuple(row) for row in connection.execute(query)]

    def oldest_queued_created_at(self) -> datetime | None:
        query = sa.select(sa.func.min(jobs.c.created_at)).where(jobs.c.status == JobStatus.QUEUED)
        with self.engine.connect() as connection:
            return utc(connection.execute(query).scalar())

    def queue_wait_buckets(self, bounds: Iterable[float]) -> tuple[builtins.list[int], int, float]:
        """Jobs whose run started, counted at or under each bound of their wait from submission to start;
        with the count and the sum of all waits (a Prometheus histogram's figures)."""
        bounds = list(bounds)
        started = jobs.c.queue_wait_s.is_not(None)
        query = sa.select(
            *(sa.func.coalesce(sa.func.sum(sa.case((jobs.c.queue_wait_s <= b, 1), else_=0)), 0) for b in bounds),
            sa.func.count(),
            sa.func.coalesce(sa.func.sum(jobs.c.queue_wait_s), 0.0),
        ).where(started)
        with self.engine.connect() as connection:
            row = connection.execute(query).one()
        return [int(v) for v in row[: len(bounds)]], int(row[-2]), float(row[-1])

    def figures_by_team(self, named: Collection[str]) -> builtins.list[tuple[str | None, str, int, int, int, int]]:
        """(owner, status, jobs, requests done, prompt tokens, completion tokens) over every job, by owner
        of `named` and status; every other owner's jobs summed as one owner, None: at most
        (len(named) + 1) x statuses rows, however many owners there were."""
        per_job = sa.select(
            owner_bucket(jobs.c.owner, named).label("owner"),
            jobs.c.status,
            jobs.c.requests_done,
            jobs.c.prompt_tokens,
            jobs.c.completion_tokens,
        ).subquery()
        query = sa.select(
            per_job.c.owner,
            per_job.c.status,
            sa.func.count(),
            *(sa.func.coalesce(sa.func.sum(per_job.c[name]), 0) for name in _FIGURES),
        ).group_by(per_job.c.owner, per_job.c.status)
        with self.engine.connect() as connection:
            return [
                (owner, status, int(count), int(a), int(b), int(c))
                for owner, status, count, a, b, c in connection.execute(query)
            ]

    # --- usage by team and day (GET /v2/usage) -----------------------------------------------------------

    def work_by_day(
        self, since: datetime, until: datetime, now: datetime, owner: str | None, named: Collection[str]
    ) -> builtins.list[WorkByDay]:
        """The work of jobs in [since, until), summed by owner and UTC day: each job's requests done, prompt
        and completion tokens, and shard-seconds (its run slots' hold as fair share counts it: the seconds
        its runs ran, each from its start to its end or now, times its shards: those the launcher charged,
        times what it gave each, in `charged_seconds`; the rest, at least one, in `shard_seconds`) on the day
        it ended, or today while it runs; grouped too by its request's `gpus` and `cpus`, for the caller to
        size the shards the launcher did not charge.
        `owner`: that owner's jobs only; owners outside `named` are summed as one, owner None. At most
        days x (len(named) + 1) x the hardware shapes asked for rows."""
        now = now.astimezone(UTC)
        stamp = sa.literal(now, sa.DateTime(timezone=True))
        of_job = job_shards.c.job_id == jobs.c.job_id
        charged = job_shards.c.charged_units.is_not(None)
        uncharged = sa.select(sa.func.count()).where(of_job, ~charged).correlate(jobs).scalar_subquery()
        any_shard = sa.select(sa.func.count()).where(of_job).correlate(jobs).scalar_subquery()
        charged_units = (
            sa.select(sa.func.coalesce(sa.func.sum(job_shards.c.charged_units), 0.0))
            .where(of_job)
            .correlate(jobs)
            .scalar_subquery()
        )
        end = sa.func.coalesce(jobs.c.completed_at, stamp)
        run_start = sa.func.coalesce(jobs.c.run_started_at, jobs.c.started_at)
        held = sa.func.coalesce(jobs.c.earlier_runs_s, 0.0) + sa.case(
            (sa.and_(run_start.is_not(None), end > run_start), seconds_between(run_start, end)), else_=0.0
        )
        # A job with no shards recorded yet holds one slot, sized by its request.
        unsized = sa.case((any_shard == 0, 1), else_=uncharged)
        counted: Any = sa.and_(jobs.c.completed_at >= since, jobs.c.completed_at < until)
        if since <= now < until:  # today is in the range: the jobs running now count on it
            counted = sa.or_(counted, sa.and_(jobs.c.completed_at.is_(None), jobs.c.started_at.is_not(None)))
        per_job = sa.select(
            owner_bucket(jobs.c.owner, named).label("owner"),
            sa.case(
                (jobs.c.completed_at.is_(None), sa.literal(now.date().isoformat())), else_=utc_day(jobs.c.completed_at)
            ).label("day"),
            json_scalar(jobs.c.request, "gpus").label("gpus"),
            json_scalar(jobs.c.request, "cpus").label("cpus"),
            *(sa.func.coalesce(jobs.c[name], 0).label(name) for name in _FIGURES),
            (held * unsized).label("shard_seconds"),
            (held * charged_units).label("charged_seconds"),
        ).where(counted)
        if owner is not None:
            per_job = per_job.where(jobs.c.owner == owner)
        grouped = per_job.subquery()
        keys = (grouped.c.owner, grouped.c.day, grouped.c.gpus, grouped.c.cpus)
        query = sa.select(
            *keys,
            *(sa.func.sum(grouped.c[name]) for name in _FIGURES),
            sa.func.sum(grouped.c.shard_seconds),
            sa.func.sum(grouped.c.charged_seconds),
        ).group_by(*keys)
        with self.engine.connect() as connection:
            return [
                WorkByDay(
                    row[0],
                    str(row[1]),
                    row[2],
                    row[3],
                    int(row[4]),
                    int(row[5]),
                    int(row[6]),
                    float(row[7]),
                    float(row[8] or 0),
                )
                for row in connection.execute(query)
            ]

    def submissions_by_day(
        self, since: datetime, until: datetime, owner: str | None, named: Collection[str]
    ) -> builtins.list[tuple[str | None, str, int, int]]:
        """(owner, UTC day, jobs submitted, bytes their work dirs store: inline content and checkpoints) for
        jobs submitted in [since, until); owners outside `named` summed as one, None."""
        per_job = sa.select(
            owner_bucket(jobs.c.owner, named).label("owner"),
            utc_day(jobs.c.created_at).label("day"),
            _WORK_DIR_BYTES.label("stored_bytes"),
        ).where(jobs.c.created_at >= since, jobs.c.created_at < until)
        if owner is not None:
            per_job = per_job.where(jobs.c.owner == owner)
        grouped = per_job.subquery()
        query = sa.select(
            grouped.c.owner,
            grouped.c.day,
            sa.func.count(),
            sa.func.coalesce(sa.func.sum(grouped.c.stored_bytes), 0),
        ).group_by(grouped.c.owner, grouped.c.day)
        with self.engine.connect() as connection:
            return [(row[0], str(row[1]), int(row[2]), int(row[3])) for row in connection.execute(query)]

    def work_dir_bytes_by_owner(self, owner: str | None, named: Collection[str]) -> dict[str | None, int]:
        """The bytes each owner's jobs store in their work dirs (`work_dir_bytes_of`, by owner of `named`;
        every other owner's summed as None)."""
        per_job = sa.select(owner_bucket(jobs.c.owner, named).label("owner"), _WORK_DIR_BYTES.label("stored_bytes"))
        if owner is not None:
            per_job = per_job.where(jobs.c.owner == owner)
        grouped = per_job.subquery()
        query = sa.select(grouped.c.owner, sa.func.coalesce(sa.func.sum(grouped.c.stored_bytes), 0)).group_by(
            grouped.c.owner
        )
        with self.engine.connect() as connection:
            return {bucket: int(total) for bucket, total in connection.execute(query)}

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


def _runs_charged(row: Any, started_at: datetime) -> dict[str, Any]:
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


def _count_queued(connection: sa.Connection, owner: str) -> int:
    query = sa.select(sa.func.count()).select_from(jobs).where(jobs.c.owner == owner, jobs.c.status == JobStatus.QUEUED)
    return int(connection.execute(query).scalar_one())


def _tokens_held_since(
    connection: sa.Connection, owner: str, since: datetime, excluding: str | None = None
) -> TokensOfTheDay:
    spent = sa.func.coalesce(jobs.c.prompt_tokens, 0) + sa.func.coalesce(jobs.c.completion_tokens, 0)
    estimate = sa.func.coalesce(jobs.c.estimated_tokens, 0)
    beyond = sa.case((estimate > spent, estimate - spent), else_=0)
    mine = jobs.c.owner == owner if excluding is None else sa.and_(jobs.c.owner == owner, jobs.c.job_id != excluding)
    # Three reads, each of an index's rows: the ended, the running (no end), the waiting again after an end.
    ended = sa.select(spent.label("used"), sa.literal(0).label("reserved")).where(
        mine, jobs.c.completed_at >= since, jobs.c.status != JobStatus.QUEUED
    )
    running = sa.select(spent, beyond).where(mine, jobs.c.completed_at.is_(None))
    resumed = sa.select(spent, beyond).where(mine, jobs.c.status == JobStatus.QUEUED, jobs.c.completed_at.is_not(None))
    both = sa.union_all(ended, running, resumed).subquery()
    query = sa.select(sa.func.coalesce(sa.func.sum(both.c.used), 0), sa.func.coalesce(sa.func.sum(both.c.reserved), 0))
    used, reserved = connection.execute(query).one()
    return TokensOfTheDay(int(used), int(reserved))


class _Recounted(Exception):
    """Another writer counted or changed a job's slot usage while it was being counted."""


class _Row(dict):
    """A row as inserted, read like a database row: the record of a new job without reading it back (and
    parsing a request that may be large)."""

    def __getattr__(self, name: str) -> Any:
        return self.get(name)
