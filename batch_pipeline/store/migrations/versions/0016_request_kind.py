"""The kind of a job's requests (issue 48), so that /metrics counts embeddings apart from chat.

- `batch_jobs.request_kind`: `v1`, `completion`, `chat`, `embeddings`, `responses` (the registry's names,
  `contract/kinds`), or `mixed` for an input file of several; set at submission where the request says it
  (inline content, an OpenAI batch's endpoint), else by its plan as it reads the input file. NULL for a job
  not yet planned, and for those of earlier releases.

Revision ID: 0016
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"


def upgrade() -> None:
    with op.batch_alter_table("batch_jobs") as batch:
        batch.add_column(sa.Column("request_kind", sa.String(16), nullable=True))
