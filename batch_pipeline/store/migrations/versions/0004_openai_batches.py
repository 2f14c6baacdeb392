"""OpenAI's Batch API: uploaded and generated files, and the batches (each the job of the same id) with what
OpenAI's batch object holds beyond the job: the endpoint, the input file, the validation errors, and the
output and error files once written.

Revision ID: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"


def upgrade() -> None:
    op.create_table(
        "openai_files",
        sa.Column("file_id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("filename", sa.Text, nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("path", sa.Text, nullable=False),
    )
    op.create_index("ix_openai_files_owner_created", "openai_files", ["owner", "created_at", "file_id"])
    op.create_table(
        "openai_batches",
        sa.Column("batch_id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(8), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("total", sa.BigInteger, nullable=False),
        sa.Column("errors", sa.Text, nullable=True),
        sa.Column("output_file_id", sa.String(64), nullable=True),
        sa.Column("error_file_id", sa.String(64), nullable=True),
        sa.Column("completed", sa.BigInteger, nullable=True),
        sa.Column("failed", sa.BigInteger, nullable=True),
        sa.Column("finalized_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_openai_batches_owner_created", "openai_batches", ["owner", "created_at", "batch_id"])
