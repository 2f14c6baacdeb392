"""SQL that SQLite and Postgres spell differently (usage by day, figures in stored JSON), and the UTC
readings of timestamps that SQLite returns without a zone."""

from __future__ import annotations

from collections.abc import Collection
from datetime import UTC, datetime
from typing import Any, overload

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import FunctionElement


def utc_now() -> datetime:
    return datetime.now(UTC)


@overload
def utc(value: datetime) -> datetime: ...
@overload
def utc(value: None) -> None: ...
def utc(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def owner_bucket(column: Any, named: Collection[str]) -> Any:
    """The owner when `named` holds it, else NULL: every other owner grouped as one, so that a grouping
    has at most len(named) + 1 owners however many there were."""
    return sa.case((column.in_(sorted(named)), column), else_=sa.null())


def of_owners(
    column: sa.ColumnElement[str], owners: Collection[str] | None, other_than: Collection[str] = ()
) -> sa.ColumnElement[bool]:
    """A retention group's rows: those of `owners` (None: any owner) other than those of `other_than` (the
    teams with a retention of their own)."""
    condition: sa.ColumnElement[bool] = sa.true()
    if owners is not None:
        condition = sa.and_(condition, column.in_(list(owners)))
    if other_than:
        condition = sa.and_(condition, column.not_in(list(other_than)))
    return condition


class utc_day(FunctionElement[str]):
    """A timestamp's UTC day, as text "YYYY-MM-DD"."""

    type = sa.String()
    name = "utc_day"
    inherit_cache = True


@compiles(utc_day)
def _utc_day(element: utc_day, compiler: Any, **kw: Any) -> str:
    # SQLite holds timestamps as UTC text ("YYYY-MM-DD HH:MM:SS.ffffff"), which date() reads.
    return f"date({compiler.process(element.clauses, **kw)})"


@compiles(utc_day, "postgresql")
def _utc_day_postgres(element: utc_day, compiler: Any, **kw: Any) -> str:
    return f"to_char(({compiler.process(element.clauses, **kw)}) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"


class seconds_between(FunctionElement[float]):
    """Seconds from the first timestamp to the second."""

    type = sa.Float()
    name = "seconds_between"
    inherit_cache = True


@compiles(seconds_between)
def _seconds_between(element: seconds_between, compiler: Any, **kw: Any) -> str:
    start, end = (compiler.process(clause, **kw) for clause in element.clauses)
    return f"((julianday({end}) - julianday({start})) * 86400.0)"


@compiles(seconds_between, "postgresql")
def _seconds_between_postgres(element: seconds_between, compiler: Any, **kw: Any) -> str:
    start, end = (compiler.process(clause, **kw) for clause in element.clauses)
    return f"CAST(EXTRACT(EPOCH FROM ({end} - {start})) AS DOUBLE PRECISION)"


# A JSON text Postgres' json type refuses whole (a lone surrogate's escape, an escaped NUL, which stored
# requests of older releases may hold): its scalar is read by pattern instead of failing the query.
_POSTGRES_UNPARSABLE_JSON = (
    r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    r"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\u0000"
)


class json_scalar(FunctionElement[Any]):
    """A top-level key's scalar value in a text column holding a JSON object (NULL when absent): a number or
    a string on SQLite, its text on Postgres."""

    name = "json_scalar"
    inherit_cache = False  # the key is part of the SQL, not a bound value

    def __init__(self, column: Any, key: str) -> None:
        if not key.isidentifier():
            raise ValueError(f"not a key this reads: {key!r}")
        self.key = key
        super().__init__(column)


@compiles(json_scalar)
def _json_scalar(element: json_scalar, compiler: Any, **kw: Any) -> str:
    return f"json_extract({compiler.process(element.clauses, **kw)}, '$.{element.key}')"


@compiles(json_scalar, "postgresql")
def _json_scalar_postgres(element: json_scalar, compiler: Any, **kw: Any) -> str:
    column = compiler.process(element.clauses, **kw)
    unparsable = compiler.process(sa.literal(_POSTGRES_UNPARSABLE_JSON), **kw)
    pattern = compiler.process(sa.literal(f'"{element.key}": ("[^"]*"|[-+0-9.eE]+)'), **kw)
    return (
        f"CASE WHEN {column} ~ {unparsable} THEN trim(BOTH '\"' FROM substring({column} FROM {pattern})) "
        f"ELSE json_extract_path_text(CAST({column} AS JSON), '{element.key}') END"
    )
