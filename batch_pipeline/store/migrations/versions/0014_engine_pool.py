"""The warm engine pool's figures (issue 47): `/metrics` counts the shards that found their engine warm in
the pool, those that started one there, and the engine-seconds saved.

- `batch_job_shards.engine_warm`: a completed shard that ran in the pool, whether its engine was warm;
  NULL for one that ran elsewhere, and until it completes.
- `batch_job_shards.engine_start_saved_s`: with a warm engine, what building it had taken.

Revision ID: 0014
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"


def upgrade() -> None:
    with op.batch_alter_table("batch_job_shards") as batch:
        batch.add_column(sa.Column("engine_warm", sa.Boolean, nullable=True))
        batch.add_column(sa.Column("engine_start_saved_s", sa.Float, nullable=True))
