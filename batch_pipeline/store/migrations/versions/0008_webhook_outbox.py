"""The webhook outbox (issue 28 part 2): `batch_webhook_events`, one row per job end (job.completed,
job.failed, job.cancelled, job.expired, or OpenAI's batch.* for a batch), written in the same transaction
as the job's row, with its delivery state (pending, delivered, failed after the retry window,
unsubscribed), attempts, the next attempt's time and the last error. The due-events index serves the
delivery process's read each tick.

Jobs that ended under older releases have no events: nothing is announced for them.

Revision ID: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"


def upgrade() -> None:
    op.create_table(
        "batch_webhook_events",
        sa.Column("event_id", sa.String(64), primary_key=True),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("type", sa.String(32), nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("state", sa.String(16), nullable=False, server_default="pending"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_attempt_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("delivered_to", sa.Text, nullable=False, server_default="[]"),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_batch_webhook_events_job_id", "batch_webhook_events", ["job_id"])
    op.create_index("ix_batch_webhook_events_due", "batch_webhook_events", ["state", "next_attempt_at"])
