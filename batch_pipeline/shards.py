"""The files a job's shards are made of, shared by the orchestrator (which plans and merges) and the worker.

A shard lives in a directory of the job's work dir:
  input.jsonl   one work item per line, `{"index": i, "kind": ..., "request": {...}}`, ascending index
  copies.tsv    `<index>\\t<source index>\\n` per request that repeats an earlier deterministic one of the
                shard: it is not generated again; its output is its source's (absent when none)
  results.tsv   appended by the worker as requests finish: `<index>\\t<output JSON>\\n`, in finishing order;
                the checkpoint a restarted worker resumes from
  output.tsv    the same lines sorted by index, written once the shard is complete

Tab-separated lines let the merge copy each output without parsing it (JSON text never holds a raw tab).
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import IO, Any

from pydantic import ConfigDict, TypeAdapter, ValidationError, with_config

from batch_pipeline.contract.openai import FilteredChatCompletionV2Request
from batch_pipeline.contract.records import InputRecord, RecordKind, describe_validation_error, parse_record
from batch_pipeline.contract.requests import CreateBatchCompletionsV1RequestContent
from batch_pipeline.core import io
from batch_pipeline.core.settings import settings

INPUT_FILE = "input.jsonl"
COPIES_FILE = "copies.tsv"
RESULTS_FILE = "results.tsv"
OUTPUT_FILE = "output.tsv"
# Estimating a request's cost without its tokenizer: characters per token of English text, and the output
# of a request that sets no limit (chat; a completion's default is 16, as in the OpenAI API).
CHARS_PER_TOKEN = 4
UNBOUNDED_OUTPUT_ESTIMATE = 256
# Distinct deterministic requests remembered to find repeats (~120 MB of the planner's memory when full);
# past it, repeats of requests first seen later are generated again.
DEDUP_TABLE_LIMIT = 1_000_000


@dataclass(frozen=True)
class WorkItem:
    """One request of the batch and the index its output takes in the job's output."""

    index: int
    kind: RecordKind
    request: dict[str, Any]

    def to_line(self) -> str:
        return json.dumps({"index": self.index, "kind": self.kind, "request": self.request}, ensure_ascii=False)

    @classmethod
    def from_line(cls, line: str | bytes) -> WorkItem:
        raw = json.loads(line)
        return cls(index=raw["index"], kind=raw["kind"], request=raw["request"])


@dataclass(frozen=True)
class ItemSize:
    """What a work item weighs: its prompts (times `n`), and the tokens it reads and writes, estimated."""

    prompts: int
    tokens: int


@dataclass(frozen=True)
class ShardSpec:
    """What the orchestrator hands to a shard launcher."""

    shard_index: int
    directory: str
    item_count: int  # outputs the shard owes, copies included
    prompt_count: int
    estimated_tokens: int = 0
    copy_count: int = 0  # of item_count: repeats filled from their source's output, listed in copies.tsv

    @property
    def input_path(self) -> str:
        return io.join(self.directory, INPUT_FILE)

    @property
    def copies_path(self) -> str:
        return io.join(self.directory, COPIES_FILE)

    @property
    def results_path(self) -> str:
        return io.join(self.directory, RESULTS_FILE)

    @property
    def output_path(self) -> str:
        return io.join(self.directory, OUTPUT_FILE)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def repeat_key(item: WorkItem) -> int | None:
    """A 128-bit digest that two work items share when they are the same request with a deterministic
    output (greedy, or a fixed seed), so that one generation can answer both; None for any other request."""
    request = item.request
    if request.get("temperature") != 0 and request.get("seed") is None:
        return None
    text = json.dumps([item.kind, request], sort_keys=True, ensure_ascii=False)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=16).digest())


@dataclass(frozen=True)
class PlanningSettings:
    """How jobs are split: at most `max_shards` shards (None: no limit), each worth at least
    `min_tokens_per_shard` estimated tokens (0: any), repeats of deterministic requests generated once."""

    max_shards: int | None
    min_tokens_per_shard: int
    deduplicate: bool = True

    @classmethod
    def from_environment(cls, slots: int | None) -> PlanningSettings:
        """The deployment's settings (BATCH_PIPELINE_MAX_SHARDS_PER_JOB, unset: `slots`, what the launcher
        runs at once; _MIN_SHARD_TOKENS; _DEDUPLICATE)."""
        configured = settings()
        return cls(
            max_shards=configured.max_shards_per_job or slots,
            min_tokens_per_shard=configured.min_shard_tokens,
            deduplicate=configured.deduplicate,
        )

    def shards_for(self, requested: int, tokens: int) -> tuple[int, str | None]:
        """The shards a job of about `tokens` estimated tokens that asked for `requested` runs in, and why
        fewer (None when as asked)."""
        used, reason = requested, None
        if self.max_shards is not None and self.max_shards < used:
            used, reason = self.max_shards, f"this deployment runs at most {self.max_shards} shard workers at once"
        if used > 1 and self.min_tokens_per_shard > 0:
            fits = max(1, tokens // self.min_tokens_per_shard)
            if fits < used:
                used = fits
                reason = (
                    f"the job's ~{tokens} tokens fill {fits} shard{'s' if fits > 1 else ''} of at least "
                    f"{self.min_tokens_per_shard} (each shard starts an engine of its own)"
                )
        return used, reason


@dataclass(frozen=True)
class ShardPlan:
    """How many shards a job runs in, against the `data_parallelism` it asked for, and why fewer."""

    requested: int
    used: int
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_shard_count(
    items: Iterator[tuple[WorkItem, ItemSize]], requested: int, settings: PlanningSettings
) -> tuple[ShardPlan, Iterator[tuple[WorkItem, ItemSize]]]:
    """Shards for a job: as many as asked, but no more than the deployment runs at once and no more than
    the work fills at the settings' least tokens a shard, since every shard pays a whole engine start
    (10-20 s on the CPU) before its first token.

    Reads ahead only as far as the decision needs (at most the tokens of the shards it may use); returns the
    plan and the items, those read ahead included.
    """
    most = requested if settings.max_shards is None else min(requested, settings.max_shards)
    tokens = 0
    if most > 1 and settings.min_tokens_per_shard > 0:
        read_ahead: list[tuple[WorkItem, ItemSize]] = []
        for entry in items:
            read_ahead.append(entry)
            tokens += entry[1].tokens
            if tokens >= most * settings.min_tokens_per_shard:
                break
        items = itertools.chain(read_ahead, items)
    used, reason = settings.shards_for(requested, tokens)
    return ShardPlan(requested=requested, used=used, reason=reason), items


def write_shards(
    items: Iterable[tuple[WorkItem, ItemSize]], num_shards: int, work_dir: str, deduplicate: bool = False
) -> list[ShardSpec]:
    """Stream items into `num_shards` shard inputs, each item to the least-loaded shard by estimated tokens.

    With `deduplicate`, a request that repeats an earlier deterministic one goes to its source's shard as a
    copy (copies.tsv), weighing nothing. One pass; memory bounded by DEDUP_TABLE_LIMIT. Shards with
    nothing to do are not returned.
    """
    directories = [io.join(work_dir, "shards", f"{k:03d}") for k in range(num_shards)]
    loads = [(0, k) for k in range(num_shards)]  # heap of (estimated tokens assigned, shard)
    item_counts = [0] * num_shards
    prompt_counts = [0] * num_shards
    token_counts = [0] * num_shards
    copy_counts = [0] * num_shards
    sources: dict[int, int] = {}  # repeat key -> index * num_shards + shard of its first request
    if io.is_local(work_dir):  # the job's prompts and outputs: for the worker's user alone
        for directory in [work_dir, io.join(work_dir, "shards"), *directories]:
            make_private_directory(directory)
    with contextlib.ExitStack() as stack:
        writers = []
        copy_writers: dict[int, IO[str]] = {}
        for directory in directories:
            io.makedirs(directory)
            writers.append(stack.enter_context(io.atomic_write(io.join(directory, INPUT_FILE))))
        for item, size in items:
            key = repeat_key(item) if deduplicate else None
            if key is not None and key in sources:
                source, k = divmod(sources[key], num_shards)
                if k not in copy_writers:
                    copy_writers[k] = stack.enter_context(io.atomic_write(io.join(directories[k], COPIES_FILE)))
                copy_writers[k].write(f"{item.index}\t{source}\n")
                copy_counts[k] += 1
            else:
                load, k = heapq.heappop(loads)
                writers[k].write(item.to_line() + "\n")
                token_counts[k] += size.tokens
                heapq.heappush(loads, (load + size.tokens, k))
                if key is not None and len(sources) < DEDUP_TABLE_LIMIT:
                    sources[key] = item.index * num_shards + k
            item_counts[k] += 1
            prompt_counts[k] += size.prompts
    return [
        ShardSpec(
            shard_index=k,
            directory=directories[k],
            item_count=item_counts[k],
            prompt_count=prompt_counts[k],
            estimated_tokens=token_counts[k],
            copy_count=copy_counts[k],
        )
        for k in range(num_shards)
        if item_counts[k]
    ]


def read_copies(path: str) -> dict[int, list[int]]:
    """A shard's copies, by source index: `{source: [copy index, ...]}`; empty when it has none."""
    copies: dict[int, list[int]] = {}
    if not io.exists(path):
        return copies
    with io.open_file(path, "r", encoding="utf-8") as handle:
        for line in handle:
            index, _, source = line.partition("\t")
            copies.setdefault(int(source), []).append(int(index))
    return copies


def make_private_directory(path: str) -> None:
    """A local directory only its owner may enter (0700, whatever the umask), made if missing. The files
    in it are written 0600 as well: the code_evaluator sandbox's uids and other local users read nothing."""
    local = io.filesystem(path)[1]
    os.makedirs(local, mode=0o700, exist_ok=True)
    os.chmod(local, 0o700)


def read_work_items(path: str) -> Iterator[WorkItem]:
    with io.open_file(path, "rb") as handle:
        for line in handle:
            if line.strip():
                yield WorkItem.from_line(line)


def format_result(index: int, output: dict[str, Any]) -> str:
    return f"{index}\t{json.dumps(output, ensure_ascii=False)}\n"


def iter_result_lines(handle: IO[str]) -> Iterator[tuple[int, str]]:
    """`(index, output JSON)` of each complete line; a torn last line (the writer was killed) is skipped."""
    for line in handle:
        if not line.endswith("\n"):
            return
        index, _, payload = line.partition("\t")
        yield int(index), payload[:-1]


class MissingResult(RuntimeError):
    pass


def write_output_array(output: IO[str], results: Iterable[tuple[int, str]], expected: int) -> int:
    """Write `(index, output JSON)` pairs, which must run 0, 1, ..., expected - 1, as one JSON array into
    `output` (an atomic write's handle). Raises MissingResult at a gap or a short count, so that the atomic
    write leaves no file."""
    written = 0
    output.write("[")
    for index, payload in results:
        if index != written:
            raise MissingResult(f"no result for request {written}")
        output.write(",\n" if written else "\n")
        output.write(payload)
        written += 1
    if written != expected:
        raise MissingResult(f"{written} results, expected {expected}")
    output.write("\n]\n")
    return written


def count_lines(path: str) -> int:
    if not io.exists(path):
        return 0
    with io.open_file(path, "rb") as handle:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 20), b""))


def shard_directories(work_dir: str) -> list[str]:
    fs, root = io.filesystem(io.join(work_dir, "shards"))
    if not fs.exists(root):
        return []
    return sorted(
        io.join(work_dir, "shards", path.rstrip("/").rsplit("/", 1)[-1]) for path in fs.ls(root, detail=False)
    )


def progress(work_dir: str) -> tuple[int, int]:
    """(requests finished, requests planned) of a job, read from its shards' checkpoints (for merging what
    a stopped run finished; status reads take the job store's counts)."""
    done = total = 0
    for directory in shard_directories(work_dir):
        total += count_lines(io.join(directory, INPUT_FILE)) + count_lines(io.join(directory, COPIES_FILE))
        done += count_lines(io.join(directory, RESULTS_FILE))
    return done, total


def partial_outputs(work_dir: str, missing: Callable[[int], str]) -> Iterator[tuple[int, str]]:
    """Every planned request in index order: its result where one was checkpointed, else `missing(index)`.

    For jobs stopped before the end (cancelled, out of time), so the finished work is not lost.
    """

    def shard_stream(directory: str) -> Iterator[tuple[int, str]]:
        results: dict[int, str] = {}
        results_path = io.join(directory, RESULTS_FILE)
        if io.exists(results_path):
            with io.open_file(results_path, "r", encoding="utf-8") as handle:
                results = dict(iter_result_lines(handle))
        copies = sorted(index for indices in read_copies(io.join(directory, COPIES_FILE)).values() for index in indices)
        generated = (item.index for item in read_work_items(io.join(directory, INPUT_FILE)))
        for index in heapq.merge(generated, copies):
            yield index, results.get(index) or missing(index)

    yield from heapq.merge(*(shard_stream(d) for d in shard_directories(work_dir)), key=lambda pair: pair[0])


def merge_sorted_outputs(output_paths: list[str]) -> Iterator[tuple[int, str]]:
    """All shards' sorted outputs as one stream in index order (a k-way merge: one line per shard in memory)."""
    with contextlib.ExitStack() as stack:
        streams = [
            iter_result_lines(stack.enter_context(io.open_file(path, "r", encoding="utf-8"))) for path in output_paths
        ]
        yield from heapq.merge(*streams, key=lambda pair: pair[0])


@dataclass(frozen=True)
class ShardTask:
    """Everything a worker needs, as the orchestrator sends it (JSON-serialisable)."""

    shard: ShardSpec
    model_config: dict[str, Any]
    shard_count: int = 1  # shards of the job, this one included
    deadline: float | None = None  # epoch seconds; the job's max_runtime_sec
    job_id: str = ""
    hardware: dict[str, Any] = field(default_factory=dict)  # the request's gpus, gpu_type, cpus, memory, storage
    labels: dict[str, str] = field(default_factory=dict)
    tool_config: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> ShardTask:
        """The task as the worker receives it, checked field by field: a task of another release (a renamed
        or missing field) fails here, naming the field, not steps later."""
        try:
            return _SHARD_TASK.validate_python(raw)
        except ValidationError as exc:
            raise ValueError(f"not a shard task of this release: {describe_validation_error(exc)}") from None


@with_config(ConfigDict(extra="forbid"))
@dataclass
class ShardStats:
    """What a worker did with its shard: counted as it runs, reported last (JSON-serialisable)."""

    shard_index: int
    items: int
    resumed: int = 0
    generated: int = 0
    deduplicated: int = 0  # requests answered by an identical deterministic request's output
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    engine_start_s: float = 0.0
    generate_s: float = 0.0
    wall_s: float = 0.0
    unsupported_engine_args: list[str] = field(default_factory=list)
    dtype: str | None = None  # what the engine computed in, and why (the request's, the model's, or the CPU's)
    dtype_reason: str | None = None
    # code_evaluator runs: executions, how many failed or ran out of time, and the sandbox's isolation
    tool_executions: int = 0
    tool_failed_executions: int = 0
    tool_timed_out_executions: int = 0
    sandbox: dict[str, str] | None = None
    tool_config: str | None = None  # with a tool_config: TOOL_APPLIED, or TOOL_NOT_APPLIED and why

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> ShardStats:
        """The stats as the orchestrator receives them, checked as ShardTask.from_dict checks a task, and
        stricter: every field must be there and no other, since a default would stand in for a renamed
        field unnoticed."""
        problems = [f"{name}: Field required" for name in _DEFAULTED_STATS if isinstance(raw, dict) and name not in raw]
        try:
            stats = _SHARD_STATS.validate_python(raw)
        except ValidationError as exc:
            problems.append(describe_validation_error(exc))
        else:
            if not problems:
                return stats
        raise ValueError(f"not shard stats of this release: {'; '.join(problems)}")


_SHARD_TASK: TypeAdapter[ShardTask] = TypeAdapter(ShardTask)
_SHARD_STATS: TypeAdapter[ShardStats] = TypeAdapter(ShardStats)
# The fields validation alone would let a report leave out.
_DEFAULTED_STATS = tuple(
    f.name for f in fields(ShardStats) if f.default is not MISSING or f.default_factory is not MISSING
)
