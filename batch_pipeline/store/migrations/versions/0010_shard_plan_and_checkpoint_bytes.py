"""A job's shard plan kept from its first run, and its checkpoints' bytes (issue 28 leftovers).

- `batch_jobs.shard_plan`: the shard plan the job's first run made (JSON: the shards asked for and used,
  why fewer, whether repeats were copied). Every later run of the job (a retry, a resume) writes the same
  shards from it, whatever BATCH_PIPELINE_MAX_SHARDS_PER_JOB, _MIN_SHARD_TOKENS or _DEDUPLICATE say by
  then: each checkpointed result lies in the shard that plan put its request in.
- `batch_job_shards.checkpoint_bytes`: the bytes of a shard's checkpoint (`results.tsv`, and `output.tsv`
  once it completed), as measured when the shard was planned and when each of its attempts ended;
  `batch_jobs.checkpoint_bytes` their sum, counted in the team's stored bytes (usage, `max_stored_bytes`)
  until retention deletes the work dir (then 0).

Rows of older releases have none of these (NULL, 0): their runs plan their shards from the settings, as
before, and their checkpoints count nothing.

Revision ID: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"


def upgrade() -> None:
    with op.batch_alter_table("batch_jobs") as batch:
        batch.add_column(sa.Column("shard_plan", sa.Text, nullable=True))
        batch.add_column(sa.Column("checkpoint_bytes", sa.BigInteger, nullable=True))
    with op.batch_alter_table("batch_job_shards") as batch:
        batch.add_column(sa.Column("checkpoint_bytes", sa.BigInteger, nullable=False, server_default="0"))
