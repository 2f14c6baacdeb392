"""The job store: one table of batch jobs, shared by the API (which writes requests) and the sensor (which
turns them into Dagster runs). SQLite in dagster_home/ by default; any SQLAlchemy URL (Postgres) in
production.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from functools import cached_property
from types import SimpleNamespace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError

from batch_pipeline.contract import CreateBatchCompletionsV2Request

metadata = sa.MetaData()

jobs = sa.Table(
    "batch_jobs",
    metadata,
    sa.Column("job_id", sa.String(64), primary_key=True),
    sa.Column("owner", sa.String(128), nullable=False, index=True),
    sa.Column("idempotency_key", sa.String(256), nullable=True),
    sa.Column("request", sa.Text, nullable=False),
    sa.Column("priority", sa.String(64), nullable=True),
    sa.Column("labels", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, index=True),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("run_id", sa.String(64), nullable=True, index=True),
    sa.Column("cancelled_at", sa.DateTime(timezone=True), nullable=True),
    # Added after the first release; `_add_missing_columns` brings older databases up to date.
    sa.Column("request_sha256", sa.String(64), nullable=True),  # what an Idempotency-Key was first used for
    sa.Column("failed_at", sa.DateTime(timezone=True), nullable=True),  # the job could not become a run
    sa.Column("failure_reason", sa.Text, nullable=True),
    sa.UniqueConstraint("owner", "idempotency_key", name="uq_owner_idempotency_key"),
)


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
    failed_at: datetime | None = None
    failure_reason: str | None = None

    @cached_property
    def request(self) -> dict[str, Any]:
        """The stored request, parsed when first asked for: a status read needs only a few of its fields."""
        return json.loads(self.request_json)

    @classmethod
    def from_row(cls, row: Any) -> JobRecord:
        return cls(
            job_id=row.job_id,
            owner=row.owner,
            request_json=row.request,
            priority=row.priority,
            labels=json.loads(row.labels),
            created_at=_utc(row.created_at),
            expires_at=_utc(row.expires_at),
            run_id=row.run_id,
            cancelled_at=_utc(row.cancelled_at) if row.cancelled_at else None,
            idempotency_key=row.idempotency_key,
            failed_at=_utc(row.failed_at) if row.failed_at else None,
            failure_reason=row.failure_reason,
        )


def default_store_url() -> str:
    home = os.environ.get("DAGSTER_HOME", "dagster_home")
    return os.environ.get("BATCH_PIPELINE_JOBS_DB", f"sqlite:///{os.path.abspath(home)}/batch_jobs.db")


class JobStore:
    def __init__(self, url: str | None = None) -> None:
        url = url or default_store_url()
        options: dict[str, Any] = {}
        if url.startswith("sqlite"):
            # The API's threads and the daemon's sensor write the same file: wait for the lock, don't fail.
            options["connect_args"] = {"timeout": 30, "check_same_thread": False}
            _create_private(make_url(url).database)
        self.engine = sa.create_engine(url, **options)
        if url.startswith("sqlite"):
            sa.event.listen(self.engine, "connect", _sqlite_wal)
        metadata.create_all(self.engine)
        _add_missing_columns(self.engine)

    def create(
        self,
        owner: str,
        request: CreateBatchCompletionsV2Request | dict[str, Any],
        max_runtime_sec: int,
        idempotency_key: str | None = None,
        run_id: str | None = None,
    ) -> tuple[JobRecord, bool]:
        """Store a new job in one transaction; with an idempotency key already used by this owner, return
        that job instead, or raise IdempotencyConflict if it was used for a different request. The second
        value says whether a job was created. A job stored with the run that already executes it (a
        launchpad run) is never launched again."""
        if isinstance(request, CreateBatchCompletionsV2Request):
            # Serialized by pydantic straight to JSON: no dict copy of a large inline request.
            request_json = request.model_dump_json(by_alias=True, exclude_none=True)
            priority, labels = request.priority, request.labels
        else:
            request_json = json.dumps(request)
            priority, labels = request.get("priority"), request.get("labels") or {}
        now = datetime.now(timezone.utc)
        row = {
            "job_id": f"batch-{uuid.uuid4().hex}",
            "owner": owner,
            "idempotency_key": idempotency_key,
            "request": request_json,
            "request_sha256": _sha256(request_json) if idempotency_key is not None else None,
            "priority": priority,
            "labels": json.dumps(labels),
            "created_at": now,
            "expires_at": now + timedelta(seconds=max_runtime_sec),
            "run_id": run_id,
            "cancelled_at": None,
        }
        try:
            with self.engine.begin() as connection:
                connection.execute(jobs.insert().values(**row))
        except IntegrityError:
            if idempotency_key is None:
                raise
            existing = self._one(sa.and_(jobs.c.owner == owner, jobs.c.idempotency_key == idempotency_key))
            if existing is None:
                raise
            stored_sha256 = self._request_sha256(existing.job_id)
            # Rows stored before the hash was kept have none: they keep the old answer, the first job.
            if stored_sha256 is not None and stored_sha256 != row["request_sha256"]:
                raise IdempotencyConflict(
                    f"Idempotency-Key {idempotency_key!a} was already used for a different request "
                    f"(job {existing.job_id}); use a new key for a new request"
                ) from None
            return existing, False
        # The record as stored, without reading back (and parsing) a request that may be tens of MB.
        return JobRecord.from_row(SimpleNamespace(**row, failed_at=None, failure_reason=None)), True

    def get(self, job_id: str) -> JobRecord | None:
        # Not an id the store makes (longer than its column, a NUL Postgres cannot compare): absent, not an error.
        if len(job_id) > jobs.c.job_id.type.length or "\x00" in job_id:
            return None
        return self._one(jobs.c.job_id == job_id)

    def list(self, owner: str | None = None, limit: int = 1000) -> list[JobRecord]:
        query = sa.select(jobs).order_by(jobs.c.created_at.desc()).limit(limit)
        if owner is not None:
            query = query.where(jobs.c.owner == owner)
        with self.engine.connect() as connection:
            return [JobRecord.from_row(row) for row in connection.execute(query)]

    def awaiting_launch(self) -> Iterator[str]:
        """Ids of the jobs without a Dagster run that nobody cancelled and that did not fail, oldest first;
        the caller reads each record when it gets to it, so large requests are not all held at once."""
        query = (
            sa.select(jobs.c.job_id)
            .where(jobs.c.run_id.is_(None), jobs.c.cancelled_at.is_(None), jobs.c.failed_at.is_(None))
            .order_by(jobs.c.created_at)
        )
        with self.engine.connect() as connection:
            job_ids = connection.execute(query).scalars().all()
        return iter(job_ids)

    def mark_failed(self, job_id: str, reason: str) -> None:
        """A job that cannot become a run: it is never taken again, and reads `failed` with the reason."""
        with self.engine.begin() as connection:
            connection.execute(
                jobs.update()
                .where(jobs.c.job_id == job_id, jobs.c.run_id.is_(None), jobs.c.failed_at.is_(None))
                .values(failed_at=datetime.now(timezone.utc), failure_reason=reason)
            )

    def link_run(self, job_id: str, run_id: str) -> None:
        with self.engine.begin() as connection:
            connection.execute(jobs.update().where(jobs.c.job_id == job_id).values(run_id=run_id))

    def set_priority(self, job_id: str, priority: str | None) -> None:
        with self.engine.begin() as connection:
            connection.execute(jobs.update().where(jobs.c.job_id == job_id).values(priority=priority))

    def cancel_before_launch(self, job_id: str) -> bool:
        """Mark a job cancelled if no run was made for it yet; False when a run already exists."""
        with self.engine.begin() as connection:
            result = connection.execute(
                jobs.update()
                .where(jobs.c.job_id == job_id, jobs.c.run_id.is_(None), jobs.c.cancelled_at.is_(None))
                .values(cancelled_at=datetime.now(timezone.utc))
            )
        return result.rowcount == 1

    def mark_cancelled(self, job_id: str) -> None:
        with self.engine.begin() as connection:
            connection.execute(
                jobs.update()
                .where(jobs.c.job_id == job_id, jobs.c.cancelled_at.is_(None))
                .values(cancelled_at=datetime.now(timezone.utc))
            )

    def _request_sha256(self, job_id: str) -> str | None:
        with self.engine.connect() as connection:
            return connection.execute(sa.select(jobs.c.request_sha256).where(jobs.c.job_id == job_id)).scalar()

    def _one(self, condition: Any) -> JobRecord | None:
        with self.engine.connect() as connection:
            row = connection.execute(sa.select(jobs).where(condition)).first()
        return JobRecord.from_row(row) if row else None


def _sha256(text: str, chunk_chars: int = 1 << 20) -> str:
    """The hash of a text's UTF-8 bytes, encoded a slice at a time rather than copied whole."""
    digest = hashlib.sha256()
    for start in range(0, len(text), chunk_chars):
        digest.update(text[start:start + chunk_chars].encode())
    return digest.hexdigest()


def _create_private(database: str | None) -> None:
    """Create the SQLite file readable by its owner only, before SQLite does (with the umask's mode); its
    WAL and shared-memory files take the database's mode. Jobs hold prompts: no other user reads them."""
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    os.close(os.open(database, os.O_CREAT | os.O_RDWR, 0o600))
    for path in (database, f"{database}-wal", f"{database}-shm"):
        if os.path.exists(path) and os.stat(path).st_mode & 0o077:
            os.chmod(path, 0o600)  # made by an older release with the umask's mode


def _add_missing_columns(engine: sa.Engine) -> None:
    """Columns added since a database was created, added to it (idempotent; Alembic will take this over)."""
    present = {column["name"] for column in sa.inspect(engine).get_columns(jobs.name)}
    missing = [column for column in jobs.columns if column.name not in present]
    if not missing:
        return
    for column in missing:
        column_type = column.type.compile(dialect=engine.dialect)
        try:
            with engine.begin() as connection:
                connection.exec_driver_sql(f"ALTER TABLE {jobs.name} ADD COLUMN {column.name} {column_type}")
        except sa.exc.DBAPIError:
            # Another process (the API, the daemon) starting at the same moment may have added it first.
            if column.name not in {c["name"] for c in sa.inspect(engine).get_columns(jobs.name)}:
                raise


def _sqlite_wal(dbapi_connection: Any, _: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


def _utc(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
