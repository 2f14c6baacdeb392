"""Reading the records of an input file (or of inline content) as typed requests."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from batch_pipeline.contract.openai import FilteredChatCompletionV2Request, FilteredCompletionV2Request
from batch_pipeline.contract.requests import CreateBatchCompletionsV1RequestContent

InputRecord = CreateBatchCompletionsV1RequestContent | FilteredCompletionV2Request | FilteredChatCompletionV2Request
RecordKind = Literal["v1", "completion", "chat"]

_ADAPTERS: dict[RecordKind, TypeAdapter[Any]] = {
    "v1": TypeAdapter(CreateBatchCompletionsV1RequestContent),
    "completion": TypeAdapter(FilteredCompletionV2Request),
    "chat": TypeAdapter(FilteredChatCompletionV2Request),
}


class RecordError(ValueError):
    """A record of the input is not a valid request; the message names the record and the field."""


def record_kind(record: Any) -> RecordKind:
    """Which request type a raw record is: v1 content has `prompts`, a chat request `messages`."""
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, found {type(record).__name__}")
    if "messages" in record:
        return "chat"
    if "prompts" in record:
        return "v1"
    if "prompt" in record:
        return "completion"
    raise RecordError("expected `prompts` (v1 content), `prompt` (completion) or `messages` (chat)")


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
