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

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from batch_pipeline.contract.kinds import USAGE_NAMES
from batch_pipeline.contract.records import RecordKind
from batch_pipeline.core import io

INPUT_FILE = "input.jsonl"
COPIES_FILE = "copies.tsv"
RESULTS_FILE = "results.tsv"
OUTPUT_FILE = "output.tsv"


@dataclass(frozen=True)
class CachedResult:
    """Where a request's result is in its team's result cache (`shards/result_cache.py`): the line of a payload
    file holding the output of the job that computed it, and its tokens. The output itself is read only as
    its shard's checkpoint is written (`shards/result_cache.CachedOutputs`): a plan holds locations, not
    outputs (an embedding's or a long completion's are large)."""

    payload_path: str
    payload_offset: int
    payload_length: int
    job_id: str
    prompt_tokens: int
    completion_tokens: int
    # What the request weighs should its payload turn out unreadable and it be generated after all.
    estimated_tokens: int = 0


@dataclass(frozen=True)
class WorkItem:
    """One request of the batch and the index its output takes in the job's output; `cached`, as a plan
    reads it: where its result is, if its team's cache holds one (never written to the shard's input)."""

    index: int
    kind: RecordKind
    request: dict[str, Any]
    cached: CachedResult | None = field(default=None, compare=False, repr=False)

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
    item_count: int  # outputs the shard owes, copies included
    prompt_count: int
    estimated_tokens: int = 0
    copy_count: int = 0  # of item_count: repeats filled from their source's output, listed in copies.tsv
    # of item_count: answered from the team's result cache, their results in the checkpoint as planned
    cached_count: int = 0
    cached_prompt_tokens: int = 0
    cached_completion_tokens: int = 0

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


def token_counts(output: dict[str, Any]) -> tuple[int, int]:
    """(prompt, completion) tokens of one output: v1 CompletionOutput counts, or an OpenAI object's usage
    under the names its kind gives them."""
    if "usage" in output:
        usage = output["usage"]
        for prompt, generated in USAGE_NAMES:  # each kind names them in its usage (contract/kinds)
            if prompt in usage:
                # an embedding's usage has no completion tokens, as OpenAI's
                return usage[prompt], usage.get(generated, 0)
    return output.get("num_prompt_tokens", 0), output.get("num_completion_tokens", 0)


def count_lines(path: str) -> int:
    if not io.exists(path):
        return 0
    with io.open_file(path, "rb") as handle:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 20), b""))


def checkpoint_bytes(directory: str) -> int:
    """The bytes of a shard's checkpoint: its results file, and its sorted output once it completed."""
    paths = [io.join(directory, name) for name in (RESULTS_FILE, OUTPUT_FILE)]
    return sum(io.size(path) for path in paths if io.exists(path))


def shard_directories(work_dir: str) -> list[str]:
    fs, root = io.filesystem(io.join(work_dir, "shards"))
    if not fs.exists(root):
        return []
    return sorted(
        io.join(work_dir, "shards", path.rstrip("/").rsplit("/", 1)[-1]) for path in fs.ls(root, detail=False)
    )
