"""Fair share and usage charge what a job's runs used (issue 44 finding 4, issue 46 item 5).

- `batch_jobs.run_started_at`: when the job's latest run started (`started_at` stays its first run's).
- `batch_jobs.earlier_runs_s`: the seconds its earlier runs ran, each from its start to its end: a resumed
  job is charged for its runs, not for the time it sat cancelled or failed between them.
- `batch_job_shards.charged_units`: what the launcher gave the shard's worker, the unit of its
  slot-seconds (the cores a local worker ran on, a pod's GPU or CPU limit), recorded as the shard starts.

Rows of older releases have none (NULL): a job's run counts from its `started_at`, and a shard is charged
what its request asks (at least one slot), as before.

Revision ID: 0012
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"


def upgrade() -> None:
    with op.batch_alter_table("batch_jobs") as batch:
        batch.add_column(sa.Column("run_started_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("earlier_runs_s", sa.Float, nullable=True))
    with op.batch_alter_table("batch_job_shards") as batch:
        batch.add_column(sa.Column("charged_units", sa.Float, nullable=True))
