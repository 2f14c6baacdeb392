"""A job's phase in its status read (issue 46 item 8): a job read `running`, 0 done, for the ~55 s its
engine took to start.

- `batch_job_shards.phase`: where the shard's current attempt is: `launched` (its worker starting),
  `engine` (the worker said it is building its engine), `generating` (reported since).
- `batch_jobs.shard_phase`: the furthest of its shards' phases, kept with the job's totals.

Rows of older releases have none (NULL): such a job reads as starting its workers until a shard reports.

Revision ID: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"


def upgrade() -> None:
    with op.batch_alter_table("batch_jobs") as batch:
        batch.add_column(sa.Column("shard_phase", sa.String(16), nullable=True))
    with op.batch_alter_table("batch_job_shards") as batch:
        batch.add_column(sa.Column("phase", sa.String(16), nullable=True))
