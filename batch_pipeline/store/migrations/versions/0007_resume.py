"""Resume: a failed, cancelled or expired job runs again on its unfinished requests only
(`POST /v2/batch-completions/{job_id}/actions/resume`). Each job row says how many times it was resumed
(its runs carry that count as a tag, so the jobs sensor tells a resumed job's new run from its old ones),
from which status and run it was last resumed, when, with which Idempotency-Key, and what its checkpoints
already held (requests and tokens kept, never generated again), counted by that resume's first run.

Rows of older releases were never resumed: every column is empty (NULL) for them.

Revision ID: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"


def upgrade() -> None:
    with op.batch_alter_table("batch_jobs") as batch:
        batch.add_column(sa.Column("resume_count", sa.Integer, nullable=True))
        batch.add_column(sa.Column("resumed_from", sa.String(16), nullable=True))
        batch.add_column(sa.Column("resumed_from_run_id", sa.String(64), nullable=True))
        batch.add_column(sa.Column("resumed_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("resume_idempotency_key", sa.String(256), nullable=True))
        for name in ("requests_kept", "prompt_tokens_kept", "completion_tokens_kept"):
            batch.add_column(sa.Column(name, sa.BigInteger, nullable=True))
