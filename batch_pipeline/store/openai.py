"""The OpenAI Batch API's rows, beside the jobs in the job store's database: files (uploaded inputs and the
output and error files a batch writes) and batches. A batch is the job of the same id: its status,
progress and counts are the job's row; its own row holds what only OpenAI's batch object has."""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from batch_pipeline.store.engine import StoreBase
from batch_pipeline.store.sql import owner_bucket, utc, utc_day, utc_now

metadata = sa.MetaData()

files = sa.Table(
    "openai_files",
    metadata,
    sa.Column("file_id", sa.String(64), primary_key=True),
    sa.Column("owner", sa.String(128), nullable=False),
    sa.Column("filename", sa.Text, nullable=False),
    sa.Column("purpose", sa.String(32), nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("path", sa.Text, nullable=False),
    # When the file expires (its upload's `expires_after`, its batch's `output_expires_after`); None: never.
    # From then on it reads as absent, and the `cleanup` schedule deletes its bytes and this row.
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True, index=True),
)

batches = sa.Table(
    "openai_batches",
    metadata,
    sa.Column("batch_id", sa.String(64), primary_key=True),
    sa.Column("owner", sa.String(128), nullable=False),
    sa.Column("endpoint", sa.String(64), nullable=False),
    sa.Column("input_file_id", sa.String(64), nullable=False),
    sa.Column("completion_window", sa.String(8), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("total", sa.BigInteger, nullable=False),
    sa.Column("errors", sa.Text, nullable=True),  # the input's validation errors (JSON list)
    sa.Column("output_file_id", sa.String(64), nullable=True),
    sa.Column("error_file_id", sa.String(64), nullable=True),
    sa.Column("completed", sa.BigInteger, nullable=True),
    sa.Column("failed", sa.BigInteger, nullable=True),
    sa.Column("finalized_at", sa.DateTime(timezone=True), nullable=True),
    # Seconds after their creation at which the batch's output and error files expire (None: never).
    sa.Column("output_expires_after", sa.Integer, nullable=True),
)


@dataclass(frozen=True)
class FileRecord:
    file_id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: datetime
    path: str
    expires_at: datetime | None = None

    def expired(self, now: datetime | None = None) -> bool:
        """Whether the file has expired: from that moment it reads as absent, cleaned up or not."""
        return self.expires_at is not None and self.expires_at <= (now or utc_now())

    @staticmethod
    def new_id() -> str:
        return f"file-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class BatchRecord:
    batch_id: str  # the job's id
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: datetime
    total: int
    errors: list[dict[str, Any]] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    completed: int | None = None
    failed: int | None = None
    finalized_at: datetime | None = None
    output_expires_after: int | None = None  # seconds after their creation its output and error files expire


@dataclass(frozen=True)
class BatchResults:
    """What finalizing a batch wrote: its output and error files (None when it had no such lines)."""

    output_file: FileRecord | None
    error_file: FileRecord | None
    completed: int
    failed: int


class OpenAIStore(StoreBase):
    # --- files ------------------------------------------------------------------------------------------

    def add_file(self, record: FileRecord) -> None:
        with self.engine.begin() as connection:
            connection.execute(files.insert().values(**_file_row(record)))

    def get_file(self, file_id: str) -> FileRecord | None:
        if not _storable_id(file_id):
            return None
        with self.engine.connect() as connection:
            row = connection.execute(sa.select(files).where(files.c.file_id == file_id)).first()
        return _file(row) if row else None

    def list_files(
        self, owner: str | None, purpose: str | None, limit: int, after: str | None
    ) -> tuple[list[FileRecord], bool]:
        """Files newest first, a page of `limit` after the file `after`; and whether more follow."""
        condition = _kept(utc_now())
        if purpose:
            condition = sa.and_(condition, files.c.purpose == purpose)
        rows, more = self._page(files, files.c.file_id, owner, limit, after, condition)
        return [_file(row) for row in rows], more

    def file_bytes_of(self, owner: str) -> int:
        """The bytes of `owner`'s files stored now (uploads, and the output and error files of its batches):
        an expired file counts until the cleanup deletes it, since its bytes are on disk until then, though it
        reads as absent from the moment it expires."""
        query = sa.select(sa.func.coalesce(sa.func.sum(files.c.bytes), 0)).where(files.c.owner == owner)
        with self.engine.connect() as connection:
            return int(connection.execute(query).scalar_one())

    def file_bytes_by_day(
        self, since: datetime, until: datetime, owner: str | None, named: Collection[str]
    ) -> list[tuple[str | None, str, int]]:
        """(owner, UTC day, bytes) of the files stored now that were stored in [since, until), by the day
        each was stored (`file_bytes_of`'s files); owners outside `named` summed as one, None."""
        per_file = sa.select(
            owner_bucket(files.c.owner, named).label("owner"), utc_day(files.c.created_at).label("day"), files.c.bytes
        ).where(files.c.created_at >= since, files.c.created_at < until)
        if owner is not None:
            per_file = per_file.where(files.c.owner == owner)
        grouped = per_file.subquery()
        query = sa.select(grouped.c.owner, grouped.c.day, sa.func.sum(grouped.c.bytes)).group_by(
            grouped.c.owner, grouped.c.day
        )
        with self.engine.connect() as connection:
            return [(bucket, str(day), int(total)) for bucket, day, total in connection.execute(query)]

    def file_bytes_by_owner(self, owner: str | None, named: Collection[str]) -> dict[str | None, int]:
        """`file_bytes_of` for each owner of `named` (every other owner's summed as None)."""
        per_file = sa.select(owner_bucket(files.c.owner, named).label("owner"), files.c.bytes)
        if owner is not None:
            per_file = per_file.where(files.c.owner == owner)
        grouped = per_file.subquery()
        query = sa.select(grouped.c.owner, sa.func.sum(grouped.c.bytes)).group_by(grouped.c.owner)
        with self.engine.connect() as connection:
            return {bucket: int(total) for bucket, total in connection.execute(query)}

    def delete_file(self, file_id: str) -> bool:
        with self.engine.begin() as connection:
            return connection.execute(files.delete().where(files.c.file_id == file_id)).rowcount > 0

    def expired_files(self, now: datetime, limit: int = 500) -> list[FileRecord]:
        """Files expired at `now`, the longest expired first (the cleanup's read, `ix_openai_files_expires_at`)."""
        query = (
            sa.select(files)
            .where(files.c.expires_at.is_not(None), files.c.expires_at <= now)
            .order_by(files.c.expires_at, files.c.file_id)
            .limit(limit)
        )
        with self.engine.connect() as connection:
            return [_file(row) for row in connection.execute(query)]

    def count_expired_files(self, now: datetime) -> int:
        """How many files are expired at `now`: what a bounded cleanup left."""
        expired = sa.and_(files.c.expires_at.is_not(None), files.c.expires_at <= now)
        query = sa.select(sa.func.count()).select_from(files).where(expired)
        with self.engine.connect() as connection:
            return int(connection.execute(query).scalar_one())

    def forget_expired_file(self, file_id: str, now: datetime) -> bool:
        """Delete the row of a file expired at `now` (its bytes deleted first); False when it is not one."""
        condition = sa.and_(files.c.file_id == file_id, files.c.expires_at.is_not(None), files.c.expires_at <= now)
        with self.engine.begin() as connection:
            return connection.execute(files.delete().where(condition)).rowcount > 0

    # --- batches ----------------------------------------------------------------------------------------

    def delete_batch(self, batch_id: str) -> None:
        with self.engine.begin() as connection:
            connection.execute(batches.delete().where(batches.c.batch_id == batch_id))

    def add_batch(self, record: BatchRecord) -> None:
        row = {**record.__dict__, "errors": json.dumps(record.errors) if record.errors else None}
        with self.engine.begin() as connection:
            connection.execute(batches.insert().values(**row))

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        if not _storable_id(batch_id):
            return None
        with self.engine.connect() as connection:
            row = connection.execute(sa.select(batches).where(batches.c.batch_id == batch_id)).first()
        return _batch(row) if row else None

    def list_batches(self, owner: str | None, limit: int, after: str | None) -> tuple[list[BatchRecord], bool]:
        rows, more = self._page(batches, batches.c.batch_id, owner, limit, after)
        return [_batch(row) for row in rows], more

    def record_results(self, batch_id: str, results: BatchResults) -> list[str]:
        """The files a batch's (last) finalization wrote, replacing those of an earlier one (a retried or
        re-executed run); returns the paths of the files replaced, for the caller to remove."""
        with self.engine.begin() as connection:
            old = connection.execute(
                sa.select(batches.c.output_file_id, batches.c.error_file_id, batches.c.output_expires_after).where(
                    batches.c.batch_id == batch_id
                )
            ).first()
            stale_ids = [file_id for file_id in (old[:2] if old else ()) if file_id]
            lifetime = old.output_expires_after if old else None
            stale: list[str] = list(
                connection.execute(sa.select(files.c.path).where(files.c.file_id.in_(stale_ids))).scalars()
            )
            if stale_ids:
                connection.execute(files.delete().where(files.c.file_id.in_(stale_ids)))
            for file in (results.output_file, results.error_file):
                if file is not None:
                    row = _file_row(file)
                    if lifetime is not None:  # the batch's output_expires_after, anchored at the file's creation
                        row["expires_at"] = file.created_at + timedelta(seconds=lifetime)
                    connection.execute(files.insert().values(**row))
            connection.execute(
                batches.update()
                .where(batches.c.batch_id == batch_id)
                .values(
                    output_file_id=results.output_file.file_id if results.output_file else None,
                    error_file_id=results.error_file.file_id if results.error_file else None,
                    completed=results.completed,
                    failed=results.failed,
                    finalized_at=utc_now(),
                )
            )
        return stale

    # --- internals --------------------------------------------------------------------------------------

    def _page(
        self,
        table: sa.Table,
        id_column: sa.Column,
        owner: str | None,
        limit: int,
        after: str | None,
        condition: Any = None,
    ) -> tuple[list[Any], bool]:
        query = sa.select(table)
        if owner is not None:
            query = query.where(table.c.owner == owner)
        if condition is not None:
            query = query.where(condition)
        if after is not None:
            with self.engine.connect() as connection:
                cursor = (
                    connection.execute(sa.select(table.c.owner, table.c.created_at).where(id_column == after)).first()
                    if _storable_id(after)
                    else None
                )
            if cursor is None or (owner is not None and cursor.owner != owner):
                return [], False
            query = query.where(
                sa.or_(
                    table.c.created_at < cursor.created_at,
                    sa.and_(table.c.created_at == cursor.created_at, id_column < after),
                )
            )
        query = query.order_by(table.c.created_at.desc(), id_column.desc()).limit(limit + 1)
        with self.engine.connect() as connection:
            rows = list(connection.execute(query))
        return rows[:limit], len(rows) > limit


def _kept(now: datetime) -> Any:
    """The files not expired at `now`."""
    return sa.or_(files.c.expires_at.is_(None), files.c.expires_at > now)


def _storable_id(value: str) -> bool:
    # Not an id this store makes (too long for its column, a NUL Postgres cannot compare): absent.
    return len(value) <= 64 and "\x00" not in value


def _file_row(record: FileRecord) -> dict[str, Any]:
    return dict(record.__dict__)


def _file(row: Any) -> FileRecord:
    return FileRecord(
        file_id=row.file_id,
        owner=row.owner,
        filename=row.filename,
        purpose=row.purpose,
        bytes=row.bytes,
        created_at=utc(row.created_at),
        path=row.path,
        expires_at=utc(row.expires_at),
    )


def _batch(row: Any) -> BatchRecord:
    return BatchRecord(
        batch_id=row.batch_id,
        owner=row.owner,
        endpoint=row.endpoint,
        input_file_id=row.input_file_id,
        completion_window=row.completion_window,
        created_at=utc(row.created_at),
        total=row.total,
        errors=json.loads(row.errors) if row.errors else None,
        output_file_id=row.output_file_id,
        error_file_id=row.error_file_id,
        completed=row.completed,
        failed=row.failed,
        finalized_at=utc(row.finalized_at),
        output_expires_after=row.output_expires_after,
    )
