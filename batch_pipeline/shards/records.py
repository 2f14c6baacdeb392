"""Input records as work items: v1 content fanned out per prompt, each item's size estimated without a
tokenizer, and the digests by which a request is told from a changed one, and repeats of a deterministic
request, and deterministic requests that differ only in their output limit, are found."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from batch_pipeline.contract.openai import FilteredChatCompletionV2Request
from batch_pipeline.contract.records import InputRecord, RecordKind, parse_record
from batch_pipeline.contract.requests import CreateBatchCompletionsV1RequestContent
from batch_pipeline.shards.format import WorkItem

# Estimating a request's cost without its tokenizer: characters per token of English text, and the output
# of a request that sets no limit (chat; a completion's default is 16, as in the OpenAI API).
CHARS_PER_TOKEN = 4
UNBOUNDED_OUTPUT_ESTIMATE = 256


@dataclass(frozen=True)
class ItemSize:
    """What a work item weighs: its prompts (times `n`), and the tokens it reads and writes, estimated."""

    prompts: int
    tokens: int


def work_items(records: Iterable[tuple[str, Any]]) -> Iterator[tuple[WorkItem, ItemSize]]:
    """Typed work items and their size, from raw records; v1 content fans out per prompt."""
    index = 0
    for where, raw in records:
        kind, record = parse_record(raw, where)
        for request, size in _split(kind, record):
            yield WorkItem(index=index, kind=kind, request=request), size
            index += 1


def _split(kind: RecordKind, record: InputRecord) -> Iterator[tuple[dict[str, Any], ItemSize]]:
    if isinstance(record, CreateBatchCompletionsV1RequestContent):
        shared = record.model_dump(exclude={"prompts"}, exclude_none=True)
        for text in record.prompts:
            yield {"prompt": text, **shared}, ItemSize(1, _text_tokens(text) + record.max_new_tokens)
        return
    request = record.model_dump(exclude_none=True, by_alias=True)
    prompts: list[Any]
    if isinstance(record, FilteredChatCompletionV2Request):
        prompts = [record.messages]
    else:
        prompt = record.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompts = list(prompt)  # several prompts: strings, or lists of token ids
        else:
            prompts = [prompt]
    output = expected_output_tokens(kind, request)
    yield request, ItemSize(len(prompts) * (record.n or 1), sum(_prompt_tokens(prompt) + output for prompt in prompts))


def expected_output_tokens(kind: RecordKind, request: dict[str, Any]) -> int:
    """The most tokens one prompt of a request may generate, all its `n` candidates together; an estimate
    where the request sets no limit."""
    if kind == "v1":
        return int(request["max_new_tokens"])
    if kind == "chat":
        limit = request.get("max_completion_tokens") or request.get("max_tokens") or UNBOUNDED_OUTPUT_ESTIMATE
    else:
        limit = request.get("max_tokens", 16)
    return limit * (request.get("n") or 1)


def _prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return _text_tokens(prompt)
    if prompt and isinstance(prompt[0], int):  # token ids
        return len(prompt)
    return sum(_message_tokens(message) for message in prompt)


def _message_tokens(message: Any) -> int:
    content = message.content
    if isinstance(content, str):
        return _text_tokens(content)
    return sum(_text_tokens(getattr(part, "text", "")) for part in content or [])


def _text_tokens(text: str) -> int:
    return len(text) // CHARS_PER_TOKEN + 1


def request_digest(item: WorkItem) -> int:
    """A 128-bit digest of a request as the plan reads it, whatever its sampling: what a later run of the
    job compares to tell a request unchanged since its result was checkpointed from one that changed."""
    return _digest(item.kind, item.request)


def repeat_key(item: WorkItem) -> int | None:
    """A 128-bit digest that two work items share when they are the same request with a deterministic
    output (greedy, or a fixed seed), so that one generation can answer both; None for any other request."""
    return _digest(item.kind, item.request) if _deterministic(item.request) else None


def _deterministic(request: dict[str, Any]) -> bool:
    """Whether a request's output is fixed by the request: greedy, or sampled with a seed."""
    return request.get("temperature") == 0 or request.get("seed") is not None


def _digest(kind: RecordKind, request: dict[str, Any]) -> int:
    text = json.dumps([kind, request], sort_keys=True, ensure_ascii=False)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=16).digest())


# The fields that cap a request's output, by kind; a chat request's newer name wins where both are set.
_OUTPUT_LIMIT_FIELDS: dict[RecordKind, tuple[str, ...]] = {
    "v1": ("max_new_tokens",),
    "completion": ("max_tokens",),
    "chat": ("max_completion_tokens", "max_tokens"),
}


def output_limit(item: WorkItem) -> int | None:
    """The most tokens the request asks for a prompt; None where it sets no limit."""
    for name in _OUTPUT_LIMIT_FIELDS[item.kind]:
        if item.request.get(name) is not None:
            return int(item.request[name])
    return None


def with_output_limit(item: WorkItem, limit: int) -> WorkItem:
    """The same request asking for at most `limit` tokens a prompt."""
    names = _OUTPUT_LIMIT_FIELDS[item.kind]
    name = next((name for name in names if item.request.get(name) is not None), names[-1])
    return replace(item, request={**item.request, name: limit})


def shared_generation_key(item: WorkItem) -> int | None:
    """A 128-bit digest that deterministic requests (greedy, or a fixed seed) share when they differ at
    most in their output limit: one generation at the largest limit answers each, cut to its own (decoding
    never looks ahead, and a seed's random stream is drawn token by token, so a shorter limit's tokens are
    the longer's first). None for any other request: unseeded samples, several candidates, a `min_tokens`,
    no limit at all, or one the engine refuses."""
    request = item.request
    if not _deterministic(request) or (request.get("n") or 1) != 1 or request.get("min_tokens"):
        return None
    limit = output_limit(item)
    if limit is None or limit < 1:  # the engine refuses a limit of 0: such a request gets its own error
        return None
    return _digest(
        item.kind, {name: value for name, value in request.items() if name not in _OUTPUT_LIMIT_FIELDS[item.kind]}
    )
