"""The files a job's shards are made of, shared by the orchestrator (which plans and merges) and the worker.

A shard lives in a directory of the job's work dir:
  input.jsonl   one work item per line, `{"index": i, "kind": ..., "request": {...}}`, ascending index
  results.tsv   appended by the worker as requests finish: `<index>\\t<output JSON>\\n`, in finishing order;
                the checkpoint a restarted worker resumes from
  output.tsv    the same lines sorted by index, written once the shard is complete

Tab-separated lines let the merge copy each output without parsing it (JSON text never holds a raw tab).
"""

from __future__ import annotations

import contextlib
import heapq
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from batch_pipeline import io
from batch_pipeline.contract.records import InputRecord, RecordKind, parse_record

INPUT_FILE = "input.jsonl"
RESULTS_FILE = "results.tsv"
OUTPUT_FILE = "output.tsv"


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
class ShardSpec:
    """What the orchestrator hands to a shard launcher."""

    shard_index: int
    directory: str
    item_count: int
    prompt_count: int

    @property
    def input_path(self) -> str:
        return io.join(self.directory, INPUT_FILE)

    @property
    def results_path(self) -> str:
        return io.join(self.directory, RESULTS_FILE)

    @property
    def output_path(self) -> str:
        return io.join(self.directory, OUTPUT_FILE)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def work_items(records: Iterable[tuple[str, Any]]) -> Iterator[tuple[WorkItem, int]]:
    """Typed work items and their weight in prompts, from raw records; v1 content fans out per prompt."""
    index = 0
    for where, raw in records:
        kind, record = parse_record(raw, where)
        for request, weight in _split(kind, record):
            yield WorkItem(index=index, kind=kind, request=request), weight
            index += 1


def _split(kind: RecordKind, record: InputRecord) -> Iterator[tuple[dict[str, Any], int]]:
    if kind == "v1":
        shared = record.model_dump(exclude={"prompts"}, exclude_none=True)
        for prompt in record.prompts:
            yield {"prompt": prompt, **shared}, 1
        return
    request = record.model_dump(exclude_none=True, by_alias=True)
    prompts = getattr(record, "prompt", None)
    many = isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))
    yield request, (len(prompts) if many else 1) * (record.n or 1)


def write_shards(items: Iterable[tuple[WorkItem, int]], num_shards: int, work_dir: str) -> list[ShardSpec]:
    """Stream items into `num_shards` shard inputs, each item to the least-loaded shard by prompt weight.

    One pass, constant memory; shards with nothing to do are not returned.
    """
    directories = [io.join(work_dir, "shards", f"{k:03d}") for k in range(num_shards)]
    loads = [(0, k) for k in range(num_shards)]  # heap of (prompts assigned, shard)
    item_counts = [0] * num_shards
    prompt_counts = [0] * num_shards
    if io.is_local(work_dir):  # the job's prompts and outputs: for the worker's user alone
        for directory in [work_dir, io.join(work_dir, "shards"), *directories]:
            make_private_directory(directory)
    with contextlib.ExitStack() as stack:
        writers = []
        for directory in directories:
            io.makedirs(directory)
            writers.append(stack.enter_context(io.atomic_write(io.join(directory, INPUT_FILE))))
        for item, weight in items:
            load, k = heapq.heappop(loads)
            writers[k].write(item.to_line() + "\n")
            item_counts[k] += 1
            prompt_counts[k] += weight
            heapq.heappush(loads, (load + weight, k))
    return [
        ShardSpec(shard_index=k, directory=directories[k], item_count=item_counts[k], prompt_count=prompt_counts[k])
        for k in range(num_shards)
        if item_counts[k]
    ]


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


def write_output_array(path: str, results: Iterable[tuple[int, str]], expected: int) -> int:
    """Write `(index, output JSON)` pairs, which must run 0, 1, ..., expected - 1, as one JSON array,
    atomically. Raises MissingResult at a gap or a short count, and then leaves no file."""
    written = 0
    with io.atomic_write(path, "w") as output:
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
    return sorted(io.join(work_dir, "shards", path.rstrip("/").rsplit("/", 1)[-1]) for path in fs.ls(root, detail=False))


def progress(work_dir: str) -> tuple[int, int]:
    """(requests finished, requests planned) of a job, read from its shards' checkpoints (for merging what
    a stopped run finished; status reads take the job store's counts)."""
    done = total = 0
    for directory in shard_directories(work_dir):
        total += count_lines(io.join(directory, INPUT_FILE))
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
        for item in read_work_items(io.join(directory, INPUT_FILE)):
            yield item.index, results.get(item.index) or missing(item.index)

    yield from heapq.merge(*(shard_stream(d) for d in shard_directories(work_dir)), key=lambda pair: pair[0])


def merge_sorted_outputs(output_paths: list[str]) -> Iterator[tuple[int, str]]:
    """All shards' sorted outputs as one stream in index order (a k-way merge: one line per shard in memory)."""
    with contextlib.ExitStack() as stack:
        streams = [
            iter_result_lines(stack.enter_context(io.open_file(path, "r", encoding="utf-8")))
            for path in output_paths
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
    def from_dict(cls, raw: dict[str, Any]) -> ShardTask:
        return cls(
            shard=ShardSpec(**raw["shard"]),
            model_config=raw["model_config"],
            shard_count=raw.get("shard_count", 1),
            deadline=raw.get("deadline"),
            job_id=raw.get("job_id", ""),
            hardware=raw.get("hardware") or {},
            labels=raw.get("labels") or {},
            tool_config=raw.get("tool_config"),
        )
