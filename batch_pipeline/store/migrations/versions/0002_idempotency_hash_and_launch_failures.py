"""What an Idempotency-Key was first used for, and jobs that could not become a run.

Revision ID: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    present = {column["name"] for column in sa.inspect(op.get_bind()).get_columns("batch_jobs")}
    with op.batch_alter_table("batch_jobs") as batch:
        for column in (
            sa.Column("request_sha256", sa.String(64), nullable=True),
            sa.Column("failed_at", sa.DateTime(timezone=True), nullable=True),
            sa.Column("failure_reason", sa.Text, nullable=True),
        ):
            if column.name not in present:
                batch.add_column(column)
