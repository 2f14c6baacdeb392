"""Retention (issue 28 part 3): the `cleanup` schedule deletes a finished job's work dir some days after it
ended (BATCH_PIPELINE_RETENTION_DAYS, or its team's `retention_days`), and OpenAI files once they expire.

- `batch_jobs.work_dir_deleted_at`: when the job's work dir was deleted (a resume is then refused, 409);
  indexed with `completed_at` for the cleanup's read (the ended jobs whose work dirs are still kept).
- `openai_files.expires_at`: when the file expires (`expires_after` of an upload, a batch's
  `output_expires_after` for its output and error files); from then on it reads as absent (404), and the
  cleanup deletes its bytes and its row. Indexed for the cleanup's read.
- `openai_batches.output_expires_after`: the seconds after their creation at which the batch's output and
  error files expire.

Rows of older releases have none of these (NULL): their work dirs are deleted as any job's, once their
job ended long enough ago; their files never expire.

Revision ID: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"


def upgrade() -> None:
    with op.batch_alter_table("batch_jobs") as batch:
        batch.add_column(sa.Column("work_dir_deleted_at", sa.DateTime(timezone=True), nullable=True))
        batch.create_index("ix_batch_jobs_retention", ["work_dir_deleted_at", "completed_at"])
    with op.batch_alter_table("openai_files") as batch:
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch.create_index("ix_openai_files_expires_at", ["expires_at"])
    with op.batch_alter_table("openai_batches") as batch:
        batch.add_column(sa.Column("output_expires_after", sa.Integer, nullable=True))
