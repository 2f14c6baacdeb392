"""A job's estimated tokens, reserved against its team's max_tokens_per_day from its admission (issue 44).

- `batch_jobs.estimated_tokens`: the prompt and completion tokens the job is estimated to use, as admission
  reckoned them (`admission.submission.estimated_tokens`). Until the job ends, its team's tokens of the day
  count the larger of this and what it has used so far; once it ends, what it used.

Rows of older releases have none (NULL): they reserve nothing, and count what they used, as before.

Revision ID: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"


def upgrade() -> None:
    with op.batch_alter_table("batch_jobs") as batch:
        batch.add_column(sa.Column("estimated_tokens", sa.BigInteger, nullable=True))
