"""The result cache (issue 49): a team's deterministic results across its jobs.

- `batch_result_cache`: the index, a row per cached result by (owner, key); the output is a line of a
  payload file in work storage.
- `batch_model_weights`: each model's weights digest, memoized by its files' sizes and mtimes.
- `batch_jobs.cached_requests`, `cached_prompt_tokens`, `cached_completion_tokens`: what a job's plan
  answered from the cache.

Revision ID: 0015
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"


def upgrade() -> None:
    op.create_table(
        "batch_result_cache",
        sa.Column("owner", sa.String(128), primary_key=True),
        sa.Column("key", sa.String(32), primary_key=True),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("weights_digest", sa.String(64), nullable=False),
        sa.Column("payload_path", sa.Text, nullable=False),
        sa.Column("payload_offset", sa.BigInteger, nullable=False),
        sa.Column("payload_length", sa.Integer, nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("completion_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_batch_result_cache_owner_created", "batch_result_cache", ["owner", "created_at"])
    op.create_index("ix_batch_result_cache_owner_model", "batch_result_cache", ["owner", "model", "weights_digest"])
    op.create_table(
        "batch_model_weights",
        sa.Column("path", sa.String(1024), primary_key=True),
        sa.Column("stat", sa.String(64), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("computed_at", sa.DateTime(timezone=True), nullable=False),
    )
    with op.batch_alter_table("batch_jobs") as batch:
        batch.add_column(sa.Column("cached_requests", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("cached_prompt_tokens", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("cached_completion_tokens", sa.BigInteger, nullable=True))
