"""Reading the records of an input file (or of inline content) as typed requests, each of the kind the
registry (`contract/kinds`) recognizes it as."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

from batch_pipeline.contract.base import WireModel
from batch_pipeline.contract.kinds import KINDS, UnknownRecord, kind_of_record

# A parsed record: the wire model of its kind.
InputRecord = WireModel
# A kind's name, as work items carry it (one of `contract.kinds.KINDS`).
RecordKind = str

_ADAPTERS: dict[RecordKind, TypeAdapter[Any]] = {kind.name: TypeAdapter(kind.wire_model) for kind in KINDS}


class RecordError(ValueError):
    """A record of the input is not a valid request; the message names the record and the field."""


def record_kind(record: Any) -> RecordKind:
    """Which kind of request a raw record is: v1 content has `prompts`, a chat request `messages`."""
    try:
        return kind_of_record(record).name
    except UnknownRecord as exc:
        raise RecordError(str(exc)) from None


def parse_record(record: Any, where: str) -> tuple[RecordKind, InputRecord]:
    try:
        kind = record_kind(record)
        return kind, _ADAPTERS[kind].validate_python(record)
    except RecordError as exc:
        raise RecordError(f"{where}: {exc}") from None
    except ValidationError as exc:
        raise RecordError(f"{where}: {describe_validation_error(exc)}") from None


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem, each naming the field path (`content.prompts.2: ...`)."""
    problems = []
    for error in exc.errors(include_url=False):
        path = ".".join(str(part) for part in error["loc"]) or "(root)"
        problems.append(f"{path}: {error['msg']}")
    return "; ".join(problems)
