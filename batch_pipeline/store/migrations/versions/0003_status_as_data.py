"""Status as data: a job's status, progress, counts and tokens live in its row (written by the pipeline as
they change), labels in a table of their own for filtering, each shard's progress in a row, and inline
content by reference (`content_path`). Rows of older releases get a status from what they recorded; those
with a run are `running` until the jobs sensor reconciles them with their run.

Revision ID: 0003
"""

import hashlib
import json

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    with op.batch_alter_table("batch_jobs") as batch:
        batch.add_column(sa.Column("status", sa.String(16), nullable=False, server_default="queued"))
        batch.add_column(sa.Column("model", sa.String(256), nullable=True))
        batch.add_column(sa.Column("content_path", sa.Text, nullable=True))
        batch.add_column(sa.Column("started_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("queue_wait_s", sa.Float, nullable=True))
        batch.add_column(sa.Column("status_detail", sa.Text, nullable=True))
        for name in ("requests_total", "requests_done", "errors", "prompt_tokens", "completion_tokens"):
            batch.add_column(sa.Column(name, sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("results", sa.Text, nullable=True))
        batch.create_index("ix_batch_jobs_owner_created", ["owner", "created_at", "job_id"])
        batch.create_index("ix_batch_jobs_status_created", ["status", "created_at"])
    op.create_table(
        "batch_job_labels",
        sa.Column("job_id", sa.String(64), primary_key=True),
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
        # Keys and values have no bound: the index holds their digest, the query compares both.
        sa.Column("digest", sa.String(64), nullable=False),
    )
    op.create_index("ix_batch_job_labels_digest", "batch_job_labels", ["digest", "job_id"])
    op.create_table(
        "batch_job_shards",
        sa.Column("job_id", sa.String(64), primary_key=True),
        sa.Column("shard_index", sa.Integer, primary_key=True),
        sa.Column("requests_total", sa.BigInteger, nullable=False),
        sa.Column("requests_done", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("errors", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("prompt_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("completion_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True),
    )
    _backfill()


def _label_digest(key: str, value: str) -> str:
    # A copy, frozen with this revision: the live store's digest may change, the rows written here may not.
    return hashlib.sha256(json.dumps([key, value]).encode()).hexdigest()


def _backfill() -> None:
    bind = op.get_bind()
    jobs = sa.table(
        "batch_jobs",
        sa.column("job_id"),
        sa.column("request"),
        sa.column("labels"),
        sa.column("run_id"),
        sa.column("cancelled_at"),
        sa.column("failed_at"),
        sa.column("status"),
        sa.column("model"),
        sa.column("completed_at"),
    )
    labels = sa.table(
        "batch_job_labels", sa.column("job_id"), sa.column("key"), sa.column("value"), sa.column("digest")
    )
    rows = bind.execute(
        sa.select(jobs.c.job_id, jobs.c.labels, jobs.c.run_id, jobs.c.cancelled_at, jobs.c.failed_at)
    ).all()
    for row in rows:
        status = (
            "failed"
            if row.failed_at
            else "cancelled"
            if row.cancelled_at
            else "queued"
            if row.run_id is None
            else "running"
        )
        request = bind.execute(sa.select(jobs.c.request).where(jobs.c.job_id == row.job_id)).scalar()
        try:
            model = str(json.loads(request)["model_config"]["model"])[:256]
        except (ValueError, KeyError, TypeError):
            model = None
        bind.execute(
            jobs.update()
            .where(jobs.c.job_id == row.job_id)
            .values(status=status, model=model, completed_at=row.failed_at or row.cancelled_at)
        )
        for key, value in json.loads(row.labels or "{}").items():
            bind.execute(
                labels.insert().values(job_id=row.job_id, key=key, value=value, digest=_label_digest(key, value))
            )
