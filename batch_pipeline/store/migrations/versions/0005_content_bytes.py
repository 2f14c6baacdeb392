"""The size of a job's inline content (`content_bytes`), as written at submission: what a team's
`max_stored_bytes` counts beside its OpenAI files, and what usage reports read. Rows of older releases
have none (their content is not counted). An index on (owner, completed_at) serves a team's tokens of
the day (`max_tokens_per_day`).

Revision ID: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    with op.batch_alter_table("batch_jobs") as batch:
        batch.add_column(sa.Column("content_bytes", sa.BigInteger, nullable=True))
        batch.create_index("ix_batch_jobs_owner_completed", ["owner", "completed_at"])
