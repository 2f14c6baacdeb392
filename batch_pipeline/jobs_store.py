"""The job store: one table of batch jobs, shared by the API (which writes requests) and the sensor (which
turns them into Dagster runs). SQLite in dagster_home/ by default; any SQLAlchemy URL (Postgres) in
production.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

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
    sa.UniqueConstraint("owner", "idempotency_key", name="uq_owner_idempotency_key"),
)


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    owner: str
    request: dict[str, Any]
    priority: str | None
    labels: dict[str, str]
    created_at: datetime
    expires_at: datetime
    run_id: str | None
    cancelled_at: datetime | None
    idempotency_key: str | None

    @classmethod
    def from_row(cls, row: Any) -> JobRecord:
        return cls(
            job_id=row.job_id,
            owner=row.owner,
            request=json.loads(row.request),
            priority=row.priority,
            labels=json.loads(row.labels),
            created_at=_utc(row.created_at),
            expires_at=_utc(row.expires_at),
            run_id=row.run_id,
            cancelled_at=_utc(row.cancelled_at) if row.cancelled_at else None,
            idempotency_key=row.idempotency_key,
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
        self.engine = sa.create_engine(url, **options)
        if url.startswith("sqlite"):
            sa.event.listen(self.engine, "connect", _sqlite_wal)
        metadata.create_all(self.engine)

    def create(
        self,
        owner: str,
        request: dict[str, Any],
        max_runtime_sec: int,
        idempotency_key: str | None = None,
        run_id: str | None = None,
    ) -> tuple[JobRecord, bool]:
        """Store a new job in one transaction; with an idempotency key already used by this owner, return
        that job instead. The second value says whether a job was created. A job stored with the run that
        already executes it (a launchpad run) is never launched again."""
        now = datetime.now(timezone.utc)
        row = {
            "job_id": f"batch-{uuid.uuid4().hex}",
            "owner": owner,
            "idempotency_key": idempotency_key,
            "request": json.dumps(request),
            "priority": request.get("priority"),
            "labels": json.dumps(request.get("labels") or {}),
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
            return existing, False
        return self.get(row["job_id"]), True

    def get(self, job_id: str) -> JobRecord | None:
        return self._one(jobs.c.job_id == job_id)

    def list(self, owner: str | None = None, limit: int = 1000) -> list[JobRecord]:
        query = sa.select(jobs).order_by(jobs.c.created_at.desc()).limit(limit)
        if owner is not None:
            query = query.where(jobs.c.owner == owner)
        with self.engine.connect() as connection:
            return [JobRecord.from_row(row) for row in connection.execute(query)]

    def awaiting_launch(self) -> Iterator[JobRecord]:
        """Jobs without a Dagster run that nobody cancelled, oldest first."""
        query = (
            sa.select(jobs)
            .where(jobs.c.run_id.is_(None), jobs.c.cancelled_at.is_(None))
            .order_by(jobs.c.created_at)
        )
        with self.engine.connect() as connection:
            rows = connection.execute(query).fetchall()
        return (JobRecord.from_row(row) for row in rows)

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

    def _one(self, condition: Any) -> JobRecord | None:
        with self.engine.connect() as connection:
            row = connection.execute(sa.select(jobs).where(condition)).first()
        return JobRecord.from_row(row) if row else None


def _sqlite_wal(dbapi_connection: Any, _: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


def _utc(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
