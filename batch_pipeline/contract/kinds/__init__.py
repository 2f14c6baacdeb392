"""The registry of request kinds: every kind of request a job may hold, each a module of its own (`v1`,
`completion`, `chat`, `embedding`, `responses`) saying what it is on the wire, how it is split into work
items and weighed, and its OpenAI endpoint. Every layer asks here; none switches on a kind's name. The
worker's side of each kind, the handler that runs it on the engine, is registered in `worker/kinds.py`.

Adding a kind: its module here, listed in `KINDS` (and in `_RECOGNIZED_FIRST`), its handler in
`worker/kinds.py`, and their tests.
"""

from __future__ import annotations

from typing import Any

from batch_pipeline.contract.kinds.base import CHARS_PER_TOKEN, RequestKind, WorkRequest, estimated_tokens
from batch_pipeline.contract.kinds.chat import CHAT
from batch_pipeline.contract.kinds.completion import COMPLETION
from batch_pipeline.contract.kinds.embedding import EMBEDDING
from batch_pipeline.contract.kinds.responses import RESPONSES
from batch_pipeline.contract.kinds.v1 import V1

# In the order the wire lists them (v2 content's shapes, the errors that name them).
KINDS: tuple[RequestKind, ...] = (V1, COMPLETION, CHAT, EMBEDDING, RESPONSES)
# Which kind a record is where it has the prompt fields of several (unknown fields are ignored): a record
# with `messages` is a chat request whatever else it holds, one with `prompts` v1 content; a responses
# record says so (its `endpoint`), as its `input` alone may be an embeddings record's.
_RECOGNIZED_FIRST: tuple[RequestKind, ...] = (RESPONSES, CHAT, V1, COMPLETION, EMBEDDING)
_BY_NAME = {kind.name: kind for kind in KINDS}
# Each kind's names of the prompt and generated tokens in an output's `usage`, distinct, in registry order.
USAGE_NAMES: tuple[tuple[str, str], ...] = tuple(dict.fromkeys(kind.usage_names for kind in KINDS))

# The OpenAI Batch API endpoints, and the kind each one's lines are; by url, as the API's enum lists them.
BATCH_ENDPOINTS: dict[str, RequestKind] = {
    kind.openai_url: kind for kind in sorted(KINDS, key=lambda kind: kind.openai_url or "") if kind.openai_url
}
# The kinds v2 inline content may be: one object of them, or a list.
INLINE_OBJECT_KINDS = tuple(kind for kind in KINDS if kind.inline_content is not None and not kind.is_inline_list())
INLINE_LIST_KINDS = tuple(kind for kind in KINDS if kind.is_inline_list())


class UnknownRecord(ValueError):
    """A record that is no kind's: its message says what each kind's record holds."""


def kind_named(name: str) -> RequestKind:
    """The kind of that name (a work item's `kind`); KeyError for none."""
    return _BY_NAME[name]


def find_kind(name: str) -> RequestKind | None:
    return _BY_NAME.get(name)


def kind_of_record(record: Any) -> RequestKind:
    """Which kind a raw record (a JSON object of an input file, an element of content) is: the kind whose
    prompt field it holds."""
    if not isinstance(record, dict):
        raise UnknownRecord(f"expected a JSON object, found {type(record).__name__}")
    for kind in _RECOGNIZED_FIRST:
        if kind.recognizes(record):
            return kind
    *others, last = (kind.described for kind in KINDS)
    raise UnknownRecord(f"expected {', '.join(others)} or {last}")


def inline_list_kind(request: Any) -> RequestKind:
    """The kind a request of a v2 content list is: the list kind whose wire model it is or whose prompt
    field it holds; else the first list kind, whose validation names what the request lacks."""
    for kind in _RECOGNIZED_FIRST:
        if kind in INLINE_LIST_KINDS and (
            isinstance(request, kind.wire_model) or (isinstance(request, dict) and kind.recognizes(request))
        ):
            return kind
    return INLINE_LIST_KINDS[0]


def inline_content_kind(value: Any) -> str | None:
    """Which kind v2 inline content is, judged the way a reader of the spec would: an object is the object
    kind's, a list its first request's kind; None for neither."""
    if isinstance(value, list):
        return inline_list_kind(value[0] if value else None).name
    for kind in INLINE_OBJECT_KINDS:
        if isinstance(value, (kind.wire_model, dict)):
            return kind.name
    return None


__all__ = [
    "BATCH_ENDPOINTS",
    "CHARS_PER_TOKEN",
    "CHAT",
    "COMPLETION",
    "EMBEDDING",
    "INLINE_LIST_KINDS",
    "INLINE_OBJECT_KINDS",
    "KINDS",
    "RESPONSES",
    "RequestKind",
    "USAGE_NAMES",
    "UnknownRecord",
    "V1",
    "WorkRequest",
    "estimated_tokens",
    "find_kind",
    "inline_content_kind",
    "inline_list_kind",
    "kind_named",
    "kind_of_record",
]
