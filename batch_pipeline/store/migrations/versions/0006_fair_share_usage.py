"""Fair share's usage as data: each team's decayed slot-seconds of its ended jobs (`batch_team_usage`,
as of a time; decayed on read, as Slurm keeps its fair-share usage), and on each job the end up to which
its use is counted there (`usage_counted_until`), so that a tick of the jobs sensor reads one row per
team, the jobs that ended since the last tick and the running ones, not every job of the last hours.
Indexes serve those reads and the waiting jobs' (status, no run yet, by age, with what admission needs:
owner, priority, deadline), read by every tick without touching the rows.

Rows of older releases are counted on the first tick after the upgrade.

Revision ID: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    with op.batch_alter_table("batch_jobs") as batch:
        batch.add_column(sa.Column("usage_counted_until", sa.DateTime(timezone=True), nullable=True))
        batch.create_index("ix_batch_jobs_usage_uncounted", ["usage_counted_until", "completed_at"])
        batch.create_index("ix_batch_jobs_holding", ["completed_at", "started_at"])
        batch.create_index(
            "ix_batch_jobs_waiting", ["status", "run_id", "created_at", "job_id", "owner", "priority", "expires_at"]
        )
    op.create_table(
        "batch_team_usage",
        sa.Column("owner", sa.String(128), primary_key=True),
        sa.Column("usage", sa.Float, nullable=False),  # slot-seconds as they count at `as_of`
        sa.Column("as_of", sa.DateTime(timezone=True), nullable=False),
    )
