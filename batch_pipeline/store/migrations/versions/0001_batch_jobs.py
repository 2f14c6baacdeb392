"""The job table of the first release. Databases made before versioning already hold it (and maybe the
columns of 0002): both migrations look before they create.

Revision ID: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None


def upgrade() -> None:
    if sa.inspect(op.get_bind()).has_table("batch_jobs"):
        return
    op.create_table(
        "batch_jobs",
        sa.Column("job_id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(128), nullable=False, index=True),
        sa.Column("idempotency_key", sa.String(256), nullable=True),
        sa.Column("request", sa.Text, nullable=False),
        sa.Column("priority", sa.String(64), nullable=True),
        sa.Column("labels", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, index=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("run_id", sa.String(64), nullable=True, index=True),
        sa.Column("cancelled_at", sa.DateTime(timezone=True), nullable=True),
        sa.UniqueConstraint("owner", "idempotency_key", name="uq_owner_idempotency_key"),
    )
