"""A team's result cache as the plan and the merge see it (issue 49): the key of a deterministic request,
the plan's lookup of its items' keys in bulk, and the results a completed shard adds.

A key is a digest of everything that decides a deterministic request's output (`CacheIdentity`): the
team, the model and the digest of its files (weights, config, tokenizer, chat template), every engine
argument the request resolved to (dtype, KV block size, quantization, max model length among them), the
machine's numerics (`models.platform.numerics_platform`), the request's kind and its whole body as the
plan reads it (prompt or messages, sampling, limits, logprobs, schema, chat template arguments). A request
that is not deterministic (sampled without a seed) has no key and is never cached.

A hit is planned as a request whose result its shard's checkpoint already holds: the worker skips it as it
skips a resumed shard's finished requests, a retry or a resume keeps it, and the merge takes it in order.
The plan carries where each hit's output is, and reads it only as it writes the hit's checkpoint line
(`CachedOutputs`): a job of a million cached embeddings never holds their outputs. The output written is
this job's answer: an OpenAI object gets an id of its own and says when this job answered it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from types import TracebackType
from typing import IO, Any

from batch_pipeline.contract.kinds import USAGE_NAMES, kind_named
from batch_pipeline.core import io
from batch_pipeline.shards.format import (
    INPUT_FILE,
    OUTPUT_FILE,
    CachedResult,
    WorkItem,
    iter_result_lines,
    read_work_items,
    token_counts,
)
from batch_pipeline.shards.records import ItemSize

# Bump when a release changes what the worker computes for the same request on the same engine (an engine
# default such as the CPU's KV block, a sampling default): results of the earlier release then never hit.
CACHE_VERSION = 1
# Items whose keys one lookup sends: the plan holds this many items (and their hits' locations) at a time.
LOOKUP_BATCH = 4096
# Payload files a plan holds open at once while it writes its hits' outputs: they come from few earlier jobs.
OPEN_PAYLOAD_FILES = 8
# The field a cached output entry names the job that computed it by.
CACHED_FROM = "cached_from_job_id"


@dataclass(frozen=True)
class CacheIdentity:
    """Whose cache, and what computes its results: the owner, the model, its files' digest, and the engine
    (every argument the request resolved to, and the machine's numerics)."""

    owner: str
    model: str
    weights_digest: str
    engine: str

    def key(self, item: WorkItem) -> str | None:
        """The 128-bit key of a deterministic request, hex; None for any other."""
        if not kind_named(item.kind).deterministic(item.request):
            return None
        text = json.dumps(
            [CACHE_VERSION, self.owner, self.model, self.weights_digest, self.engine, item.kind, item.request],
            sort_keys=True,
            ensure_ascii=False,
        )
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


# What the plan's lookup returns: of the keys asked, those the team's cache holds, with where their results are.
Lookup = Callable[[list[str]], dict[str, CachedResult]]


def with_cache_hits(
    items: Iterable[tuple[WorkItem, ItemSize]], identity: CacheIdentity, lookup: Lookup
) -> Iterator[tuple[WorkItem, ItemSize]]:
    """The items, each deterministic one the cache holds carrying where its result is (`WorkItem.cached`)
    and weighing no tokens: one lookup per LOOKUP_BATCH items."""
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, LOOKUP_BATCH)):
        keys = [identity.key(item) for item, _ in batch]
        found = lookup([key for key in dict.fromkeys(keys) if key is not None])
        for (item, size), key in zip(batch, keys):
            hit = found.get(key) if key is not None else None
            if hit is None:
                yield item, size
            else:
                cached = replace(hit, estimated_tokens=size.tokens)
                yield replace(item, cached=cached), ItemSize(prompts=size.prompts, tokens=0)


class CachedOutputs:
    """The outputs of a plan's hits, each read from its payload file as its shard's checkpoint line is
    written (`output_of`), one at a time, the last OPEN_PAYLOAD_FILES files held open. A payload cut short,
    replaced or gone since the lookup gives None: the request is generated instead."""

    def __init__(self) -> None:
        self._files: OrderedDict[str, IO[bytes] | None] = OrderedDict()
        # The plan's part of its hits' ids, as a worker's run has its own (worker/openai_requests.py).
        self._id_token = secrets.token_hex(6)

    def __enter__(self) -> CachedOutputs:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for handle in self._files.values():
            if handle is not None:
                handle.close()
        self._files.clear()

    def output_of(self, item: WorkItem) -> str | None:
        """The entry the hit `item` is answered by in this job (`cached_output`); None if unreadable."""
        hit = item.cached
        assert hit is not None
        handle = self._file(hit.payload_path)
        if handle is None:
            return None
        try:
            handle.seek(hit.payload_offset)
            payload = handle.read(hit.payload_length)
            if len(payload) != hit.payload_length:
                return None
            return cached_output(payload.decode("utf-8"), hit.job_id, item.index, self._id_token)
        except (OSError, ValueError):  # torn or replaced: generated instead
            return None

    def _file(self, path: str) -> IO[bytes] | None:
        if path in self._files:
            self._files.move_to_end(path)
            return self._files[path]
        try:
            handle: IO[bytes] | None = io.open_file(path, "rb")
        except OSError:  # gone (a DELETE, retention) since the lookup
            handle = None
        self._files[path] = handle
        if len(self._files) > OPEN_PAYLOAD_FILES:
            _, oldest = self._files.popitem(last=False)
            if oldest is not None:
                oldest.close()
        return handle


# An OpenAI object's id as the worker makes it: its kind's prefix (`chatcmpl-`, `cmpl-`, `resp_`), then the
# run's token and the request's index, last (a copy's id is made from its source's, worker/checkpoint.py).
_OPENAI_ID = re.compile(r"[A-Za-z]+[-_]")
# A tool call's id as vLLM makes it (`make_tool_call_id`): random, unique across batches.
_TOOL_CALL_ID = "chatcmpl-tool-"


def cached_output(payload: str, job_id: str, index: int, id_token: str) -> str:
    """A cached output as hit `index`'s entry in this job: the output its job computed, saying so
    (`cached_from_job_id`) and, in an OpenAI usage, that its prompt's tokens were all cached; an OpenAI
    object's id its own (of `id_token`, the plan's), and its `created` when this job answered it."""
    output = json.loads(payload)
    if not isinstance(output, dict):  # a payload file replaced under its index: never an answer
        raise ValueError("a cached output is a JSON object")
    _answered_now(output, f"{id_token}-{index}")
    output[CACHED_FROM] = job_id
    usage = output.get("usage")
    if isinstance(usage, dict):
        for prompt, _ in USAGE_NAMES:
            if isinstance(usage.get(prompt), int):
                details = "input_tokens_details" if prompt == "input_tokens" else "prompt_tokens_details"
                usage[details] = {**(usage.get(details) or {}), "cached_tokens": usage[prompt]}
                break
    return json.dumps(output, ensure_ascii=False)


def _answered_now(output: dict[str, Any], suffix: str) -> None:
    """Make `output` this job's answer, as a fresh generation's would be: ids of its own (the object's, a
    response's output items', which share its suffix, and tool calls'), and this moment as its creation."""
    old = output.get("id")
    if isinstance(old, str) and (prefix := _OPENAI_ID.match(old)):
        old_suffix = old[prefix.end() :]
        output["id"] = prefix.group() + suffix
        for part in output.get("output") or ():
            if isinstance(part, dict) and isinstance(part.get("id"), str) and part["id"].endswith("_" + old_suffix):
                part["id"] = part["id"][: -len(old_suffix)] + suffix
    for choice in output.get("choices") or ():
        message = choice.get("message") if isinstance(choice, dict) else None
        for call in (message.get("tool_calls") if isinstance(message, dict) else None) or ():
            if isinstance(call, dict) and str(call.get("id", "")).startswith(_TOOL_CALL_ID):
                call["id"] = f"{_TOOL_CALL_ID}{uuid.uuid4().hex}"
    now = int(time.time())
    for stamp in ("created", "created_at"):  # chat and completions say `created`, a response `created_at`
        if isinstance(output.get(stamp), int):
            output[stamp] = now


@dataclass(frozen=True)
class CacheableResult:
    """A completed shard's result that its team's cache may keep: its key, its output, and its tokens."""

    key: str
    payload: str
    prompt_tokens: int
    completion_tokens: int


def cacheable_results(shard_directory: str, identity: CacheIdentity) -> Iterator[CacheableResult]:
    """The results a completed shard computed for its deterministic requests (its input's, by index, in its
    sorted output), but not its error entries nor what it took from the cache itself."""
    outputs = _sorted_outputs(io.join(shard_directory, OUTPUT_FILE))
    current = next(outputs, None)
    for item in read_work_items(io.join(shard_directory, INPUT_FILE)):
        while current is not None and current[0] < item.index:
            current = next(outputs, None)
        if current is None:
            return
        if current[0] != item.index or (key := identity.key(item)) is None:
            continue
        output: dict[str, Any] = json.loads(current[1])
        if "error" in output or CACHED_FROM in output:
            continue
        prompt_tokens, completion_tokens = token_counts(output)
        yield CacheableResult(key, current[1], prompt_tokens, completion_tokens)


def _sorted_outputs(path: str) -> Iterator[tuple[int, str]]:
    with io.open_file(path, "r", encoding="utf-8") as handle:
        yield from iter_result_lines(handle)
