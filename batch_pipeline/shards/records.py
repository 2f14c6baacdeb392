"""Input records as work items: v1 content fanned out per prompt, each item's size estimated without a
tokenizer, and the digests by which a request is told from a changed one, and repeats of a deterministic
request, and deterministic requests that differ only in their output limit, are found."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from batch_pipeline.contract.kinds import kind_named
from batch_pipeline.contract.records import RecordKind, parse_record
from batch_pipeline.shards.format import WorkItem


@dataclass(frozen=True)
class ItemSize:
    """What a work item weighs: its prompts (times `n`), and the tokens it reads and writes, estimated."""

    prompts: int
    tokens: int


def work_items(records: Iterable[tuple[str, Any]]) -> Iterator[tuple[WorkItem, ItemSize]]:
    """Typed work items and their size, from raw records, split as their kind splits them (v1 content fans
    out per prompt)."""
    index = 0
    for where, raw in records:
        name, record = parse_record(raw, where)
        kind = kind_named(name)
        for work in kind.work_requests(record):
            output = kind.expected_output_tokens(work.request)
            size = ItemSize(len(work.prompt_tokens) * work.candidates, sum(t + output for t in work.prompt_tokens))
            yield WorkItem(index=index, kind=name, request=work.request), size
            index += 1


# The kind of a job's requests where they are of several (an input file may mix them).
MIXED_KINDS = "mixed"


class KindsRead:
    """The kinds of the work items passed on by `passed`: what a job's plan read."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def passed(self, items: Iterable[tuple[WorkItem, ItemSize]]) -> Iterator[tuple[WorkItem, ItemSize]]:
        for item, size in items:
            self.names.add(item.kind)
            yield item, size

    @property
    def kind(self) -> str | None:
        """The one kind read, MIXED_KINDS for several, None for none."""
        if len(self.names) > 1:
            return MIXED_KINDS
        return next(iter(self.names), None)


def expected_output_tokens(kind: RecordKind, request: dict[str, Any]) -> int:
    """The most tokens one prompt of a request may generate, all its `n` candidates together; an estimate
    where the request sets no limit."""
    return kind_named(kind).expected_output_tokens(request)


def request_digest(item: WorkItem) -> int:
    """A 128-bit digest of a request as the plan reads it, whatever its sampling: what a later run of the
    job compares to tell a request unchanged since its result was checkpointed from one that changed."""
    return _digest(item.kind, item.request)


def repeat_key(item: WorkItem) -> int | None:
    """A 128-bit digest that two work items share when they are the same request with a deterministic
    output (greedy, or a fixed seed), so that one generation can answer both; None for any other request."""
    return _digest(item.kind, item.request) if _deterministic(item) else None


def _deterministic(item: WorkItem) -> bool:
    """Whether a request's output is fixed by the request, as its kind says (greedy, or sampled with a seed;
    an embedding always)."""
    return kind_named(item.kind).deterministic(item.request)


def _digest(kind: RecordKind, request: dict[str, Any]) -> int:
    text = json.dumps([kind, request], sort_keys=True, ensure_ascii=False)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=16).digest())


def output_limit(item: WorkItem) -> int | None:
    """The most tokens the request asks for a prompt; None where it sets no limit."""
    for name in kind_named(item.kind).output_limit_fields:
        if item.request.get(name) is not None:
            return int(item.request[name])
    return None


def with_output_limit(item: WorkItem, limit: int) -> WorkItem:
    """The same request asking for at most `limit` tokens a prompt."""
    names = kind_named(item.kind).output_limit_fields
    name = next((name for name in names if item.request.get(name) is not None), names[-1])
    return replace(item, request={**item.request, name: limit})


def shared_generation_key(item: WorkItem) -> int | None:
    """A 128-bit digest that deterministic requests (greedy, or a fixed seed) share when they differ at
    most in their output limit: one generation at the largest limit answers each, cut to its own (decoding
    never looks ahead, and a seed's random stream is drawn token by token, so a shorter limit's tokens are
    the longer's first). None for any other request: unseeded samples, several candidates, a `min_tokens`,
    no limit at all, or one the engine refuses."""
    request = item.request
    if not _deterministic(item) or (request.get("n") or 1) != 1 or request.get("min_tokens"):
        return None
    limit = output_limit(item)
    if limit is None or limit < 1:  # the engine refuses a limit of 0: such a request gets its own error
        return None
    limits = kind_named(item.kind).output_limit_fields
    return _digest(item.kind, {name: value for name, value in request.items() if name not in limits})
