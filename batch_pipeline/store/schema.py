"""The job store's tables, as the newest migration leaves them (`store/migrations/`), and a job's statuses."""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum

import sqlalchemy as sa

metadata = sa.MetaData()
# Not Alembic's default name: the job store may share a database with Dagster's own storage.
SCHEMA_VERSION_TABLE = "batch_pipeline_schema_version"


class JobStatus(StrEnum):
    """A job's status as its row holds it. The wire's status (`contract.jobs.BatchCompletionsJobStatus`) has
    these and `unknown`; the contract cannot import the store, so a test keeps the two equal."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_finished(self) -> bool:
        return self in FINISHED


FINISHED = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED})

JOB_ID_LENGTH = 64  # the job_id column's bound

jobs = sa.Table(
    "batch_jobs",
    metadata,
    sa.Column("job_id", sa.String(JOB_ID_LENGTH), primary_key=True),
    sa.Column("owner", sa.String(128), nullable=False, index=True),
    sa.Column("idempotency_key", sa.String(256), nullable=True),
    # The request as stored: inline content is not in it but in the file `content_path` names.
    sa.Column("request", sa.Text, nullable=False),
    sa.Column("request_sha256", sa.String(64), nullable=True),  # what an Idempotency-Key was first used for
    sa.Column("content_path", sa.Text, nullable=True),
    sa.Column("content_bytes", sa.BigInteger, nullable=True),  # the size of that file, as written
    sa.Column("model", sa.String(256), nullable=True),
    sa.Column("priority", sa.String(64), nullable=True),
    sa.Column("labels", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, index=True),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("run_id", sa.String(64), nullable=True, index=True),  # the newest run of the job
    sa.Column("status", sa.String(16), nullable=False, server_default=JobStatus.QUEUED.value),
    sa.Column("status_detail", sa.Text, nullable=True),  # e.g. why a run is being retried
    sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("queue_wait_s", sa.Float, nullable=True),  # submission to first run start
    sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("cancelled_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("failed_at", sa.DateTime(timezone=True), nullable=True),  # the job could not become a run
    sa.Column("failure_reason", sa.Text, nullable=True),
    # Totals over the shards, kept with each progress report; final figures when the job completes.
    sa.Column("requests_total", sa.BigInteger, nullable=True),
    sa.Column("requests_done", sa.BigInteger, nullable=True),
    sa.Column("errors", sa.BigInteger, nullable=True),
    sa.Column("prompt_tokens", sa.BigInteger, nullable=True),
    sa.Column("completion_tokens", sa.BigInteger, nullable=True),
    sa.Column("results", sa.Text, nullable=True),  # the finished job's summary (JSON), as in its metadata file
    # Fair share: the end up to which the job's use of run slots is counted in its team's `team_usage` row.
    sa.Column("usage_counted_until", sa.DateTime(timezone=True), nullable=True),
    sa.UniqueConstraint("owner", "idempotency_key", name="uq_owner_idempotency_key"),
    sa.Index("ix_batch_jobs_owner_created", "owner", "created_at", "job_id"),
    sa.Index("ix_batch_jobs_status_created", "status", "created_at"),
    sa.Index("ix_batch_jobs_owner_completed", "owner", "completed_at"),  # a team's tokens of the day
    # Fair share's reads each tick: the ended jobs not yet counted, the running ones, the waiting ones.
    sa.Index("ix_batch_jobs_usage_uncounted", "usage_counted_until", "completed_at"),
    sa.Index("ix_batch_jobs_holding", "completed_at", "started_at"),
    sa.Index("ix_batch_jobs_waiting", "status", "run_id", "created_at", "job_id", "owner", "priority", "expires_at"),
)

# Fair share: each team's decayed slot-seconds of its ended jobs, as they count at `as_of`.
team_usage = sa.Table(
    "batch_team_usage",
    metadata,
    sa.Column("owner", sa.String(128), primary_key=True),
    sa.Column("usage", sa.Float, nullable=False),
    sa.Column("as_of", sa.DateTime(timezone=True), nullable=False),
)

job_labels = sa.Table(
    "batch_job_labels",
    metadata,
    sa.Column("job_id", sa.String(64), primary_key=True),
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
    # Keys and values have no bound: the index holds their digest, the query compares both.
    sa.Column("digest", sa.String(64), nullable=False),
    sa.Index("ix_batch_job_labels_digest", "digest", "job_id"),
)

job_shards = sa.Table(
    "batch_job_shards",
    metadata,
    sa.Column("job_id", sa.String(64), primary_key=True),
    sa.Column("shard_index", sa.Integer, primary_key=True),
    sa.Column("requests_total", sa.BigInteger, nullable=False),
    sa.Column("requests_done", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("errors", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("prompt_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("completion_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True),
)


def label_digest(key: str, value: str) -> str:
    return hashlib.sha256(json.dumps([key, value]).encode()).hexdigest()
