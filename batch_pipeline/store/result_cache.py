"""The result cache's index (issue 49): a team's deterministic results of its completed jobs, by the digest
of everything that decides them, each pointing at its output's line in a payload file its job wrote.

Every query names the owner: a row is found by its team's lookups alone, whatever its key. The payload
files are the caller's (work storage or S3); the rows say where they are and how many bytes they hold, so
that the team's stored bytes count them and retention and a `DELETE` know which files to remove.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from batch_pipeline.store.engine import StoreBase
from batch_pipeline.store.schema import model_weights, result_cache
from batch_pipeline.store.sql import owner_bucket, utc, utc_now

# Keys a lookup sends in one query: under SQLite's bound on parameters, and a round trip per this many.
LOOKUP_CHUNK = 900


@dataclass(frozen=True)
class CachedEntry:
    """Where a cached result is: the job that computed it, its payload file and the bytes of its line."""

    key: str
    job_id: str
    payload_path: str
    payload_offset: int
    payload_length: int
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class NewEntry:
    """A result a completed job adds to its team's cache: its key, its line in the job's payload file, and
    its tokens."""

    key: str
    payload_offset: int
    payload_length: int
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class CacheFigures:
    """A team's cache: its entries, their payload bytes, and the payload files that hold them."""

    entries: int
    payload_bytes: int
    payload_paths: list[str]


class ResultCacheStore(StoreBase):
    """A team's result cache at its URL (`JobStore`'s database)."""

    def lookup(self, owner: str, keys: Iterable[str]) -> dict[str, CachedEntry]:
        """The entries of `owner` among `keys`, by key: a query per LOOKUP_CHUNK keys."""
        found: dict[str, CachedEntry] = {}
        keys = iter(keys)
        with self.engine.connect() as connection:
            while chunk := list(itertools.islice(keys, LOOKUP_CHUNK)):
                query = sa.select(
                    result_cache.c.key,
                    result_cache.c.job_id,
                    result_cache.c.payload_path,
                    result_cache.c.payload_offset,
                    result_cache.c.payload_length,
                    result_cache.c.prompt_tokens,
                    result_cache.c.completion_tokens,
                ).where(result_cache.c.owner == owner, result_cache.c.key.in_(chunk))
                for row in connection.execute(query):
                    found[row.key] = CachedEntry(*row)
        return found

    def add(
        self, owner: str, job_id: str, model: str, weights_digest: str, payload_path: str, entries: Iterable[NewEntry]
    ) -> int:
        """A completed job's results, added to its team's cache; a key cached already keeps its entry (the
        same result). Returns how many were added."""
        added = 0
        now = utc_now()
        batches = _batched(iter(entries), LOOKUP_CHUNK)
        with self.engine.begin() as connection:
            for batch in batches:
                known = set(
                    connection.execute(
                        sa.select(result_cache.c.key).where(
                            result_cache.c.owner == owner, result_cache.c.key.in_([entry.key for entry in batch])
                        )
                    ).scalars()
                )
                rows = [
                    {
                        "owner": owner,
                        "key": entry.key,
                        "job_id": job_id,
                        "model": model,
                        "weights_digest": weights_digest,
                        "payload_path": payload_path,
                        "payload_offset": entry.payload_offset,
                        "payload_length": entry.payload_length,
                        "prompt_tokens": entry.prompt_tokens,
                        "completion_tokens": entry.completion_tokens,
                        "created_at": now,
                    }
                    for entry in {entry.key: entry for entry in batch if entry.key not in known}.values()
                ]
                if rows:
                    connection.execute(result_cache.insert(), rows)
                    added += len(rows)
        return added

    def figures(self, owner: str) -> CacheFigures:
        """What `owner`'s cache holds now."""
        with self.engine.connect() as connection:
            entries, payload_bytes = connection.execute(
                sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(result_cache.c.payload_length), 0)).where(
                    result_cache.c.owner == owner
                )
            ).one()
            paths = connection.execute(
                sa.select(result_cache.c.payload_path).where(result_cache.c.owner == owner).distinct()
            ).scalars()
            return CacheFigures(int(entries), int(payload_bytes), sorted(paths))

    def payload_bytes_of(self, owner: str) -> int:
        """The bytes of `owner`'s cached results: counted in its stored bytes."""
        query = sa.select(sa.func.coalesce(sa.func.sum(result_cache.c.payload_length), 0)).where(
            result_cache.c.owner == owner
        )
        with self.engine.connect() as connection:
            return int(connection.execute(query).scalar_one())

    def payload_bytes_by_owner(self, owner: str | None, named: Collection[str]) -> dict[str | None, int]:
        """The bytes of each owner's cached results (by owner of `named`, every other owner's summed as
        None; `owner`'s alone if given): the usage report's stored bytes."""
        bucket = owner_bucket(result_cache.c.owner, named).label("owner")
        query = sa.select(bucket, sa.func.coalesce(sa.func.sum(result_cache.c.payload_length), 0))
        if owner is not None:
            query = query.where(result_cache.c.owner == owner)
        with self.engine.connect() as connection:
            return {row[0]: int(row[1]) for row in connection.execute(query.group_by(bucket))}

    def drop(self, owner: str, created_before: datetime | None = None) -> list[str]:
        """Remove `owner`'s entries (those created before `created_before`, if given); returns the payload
        files no entry of theirs points at any more, for the caller to delete."""
        condition = result_cache.c.owner == owner
        if created_before is not None:
            condition = sa.and_(condition, result_cache.c.created_at < created_before)
        return self._drop(condition)

    def drop_other_weights(self, owner: str, model: str, weights_digest: str) -> list[str]:
        """Remove `owner`'s entries of `model` computed with weights other than `weights_digest` (they can
        never hit again); returns the payload files left with no entry."""
        return self._drop(
            sa.and_(
                result_cache.c.owner == owner,
                result_cache.c.model == model,
                result_cache.c.weights_digest != weights_digest,
            )
        )

    def _drop(self, condition: sa.ColumnElement[bool]) -> list[str]:
        """Remove the entries matching `condition`; the payload files no remaining entry points at."""
        with self.engine.begin() as connection:
            paths = set(
                connection.execute(sa.select(result_cache.c.payload_path).where(condition).distinct()).scalars()
            )
            if not paths:
                return []
            connection.execute(result_cache.delete().where(condition))
            still = set(
                connection.execute(
                    sa.select(result_cache.c.payload_path).where(result_cache.c.payload_path.in_(sorted(paths)))
                ).scalars()
            )
        return sorted(paths - still)

    def owners_with_entries_before(self, before: datetime) -> list[str]:
        """Owners with an entry created before `before`: those retention has something to expire for."""
        query = sa.select(result_cache.c.owner).where(result_cache.c.created_at < before).distinct()
        with self.engine.connect() as connection:
            return sorted(connection.execute(query).scalars())

    def weights_digest(self, path: str, stat: str) -> str | None:
        """The digest last computed for the model files at `path` when their names, sizes and mtimes had
        the digest `stat`; None if they changed since, or were never digested."""
        query = sa.select(model_weights.c.digest).where(model_weights.c.path == path, model_weights.c.stat == stat)
        with self.engine.connect() as connection:
            return connection.execute(query).scalar_one_or_none()

    def record_weights_digest(self, path: str, stat: str, digest: str) -> None:
        with self.engine.begin() as connection:
            connection.execute(model_weights.delete().where(model_weights.c.path == path))
            connection.execute(
                model_weights.insert().values(path=path, stat=stat, digest=digest, computed_at=utc(utc_now()))
            )


def _batched(entries: Iterator[NewEntry], size: int) -> Iterator[list[NewEntry]]:
    while batch := list(itertools.islice(entries, size)):
        yield batch
