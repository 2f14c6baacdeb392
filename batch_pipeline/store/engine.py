"""The job store's database: one engine (connection pool) per process and URL, its schema upgraded once
per process (Alembic, `store/migrations/`). The deployment names its URL (`Settings.job_store_url`: SQLite
in DAGSTER_HOME by default, any SQLAlchemy URL, Postgres, in production)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from batch_pipeline.core import io
from batch_pipeline.store.schema import SCHEMA_VERSION_TABLE

_engines: dict[str, sa.Engine] = {}
_engines_lock = threading.Lock()


def engine_for(url: str) -> sa.Engine:
    """The process's one engine for a URL (a connection pool), its schema upgraded when first made."""
    with _engines_lock:
        engine = _engines.get(url)
        if engine is None:
            engine = _engines[url] = _create_engine(url)
            upgrade_schema(engine)
        return engine


def _create_engine(url: str) -> sa.Engine:
    options: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("sqlite"):
        # The API's threads, the daemon's sensors and the run's steps write the same file: wait for the
        # lock, don't fail.
        options["connect_args"] = {"timeout": 30, "check_same_thread": False}
        _create_private(make_url(url).database)
    engine = sa.create_engine(url, **options)
    if url.startswith("sqlite"):
        sa.event.listen(engine, "connect", _sqlite_wal)
    return engine


def _forget_inherited_connections() -> None:
    for engine in _engines.values():
        engine.dispose(close=False)


# Step processes fork from a server that may hold pooled connections: a child opens its own.
os.register_at_fork(after_in_child=_forget_inherited_connections)


def upgrade_schema(engine: sa.Engine) -> None:
    """Bring the database to the newest schema, whichever release made it. Processes starting together
    (the API, the daemon) take turns: a lock on Postgres, a lock file beside a SQLite database."""
    from alembic import command
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", "batch_pipeline.store:migrations")
    head = ScriptDirectory.from_config(config).get_current_head()
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"version_table": SCHEMA_VERSION_TABLE})
        if context.get_current_revision() == head:
            return
    with _migration_lock(engine), engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            connection.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext('batch_pipeline_schema'))"))
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


@contextlib.contextmanager
def _migration_lock(engine: sa.Engine) -> Iterator[None]:
    database = engine.url.database if engine.dialect.name == "sqlite" else None
    if not database or database == ":memory:" or database.startswith("file:"):
        yield
        return
    with io.file_lock(f"{database}.migrate-lock"):
        yield


def _create_private(database: str | None) -> None:
    """Create the SQLite file readable by its owner only, before SQLite does (with the umask's mode); its
    WAL and shared-memory files take the database's mode. Jobs hold prompts: no other user reads them."""
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    os.close(os.open(database, os.O_CREAT | os.O_RDWR, 0o600))
    for path in (database, f"{database}-wal", f"{database}-shm"):
        if os.path.exists(path) and os.stat(path).st_mode & 0o077:
            os.chmod(path, 0o600)  # made by an older release with the umask's mode


def _sqlite_wal(dbapi_connection: Any, _: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


class StoreBase:
    """A store of one purpose over the job store's database: its engine from a SQLAlchemy URL (a deployment's:
    `Settings.job_store_url`), or shared with another store's (`engine=`), so that the stores a process uses
    share one connection pool."""

    def __init__(self, url: str = "", engine: sa.Engine | None = None) -> None:
        self.engine = engine or engine_for(url)
