"""Alembic's entry point for the job store: run on the connection `store.engine.upgrade_schema` passes in."""

from alembic import context

from batch_pipeline.store.schema import SCHEMA_VERSION_TABLE, metadata

connection = context.config.attributes["connection"]
context.configure(
    connection=connection, target_metadata=metadata, version_table=SCHEMA_VERSION_TABLE, render_as_batch=True
)
with context.begin_transaction():
    context.run_migrations()
