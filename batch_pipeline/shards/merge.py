"""A job's output from its shards' files: the k-way merge of sorted outputs, the partial output of a stopped
job, and the writer of the output's JSON array."""

from __future__ import annotations

import contextlib
import heapq
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO

from batch_pipeline.core import io
from batch_pipeline.shards.format import (
    COPIES_FILE,
    INPUT_FILE,
    RESULTS_FILE,
    count_lines,
    iter_result_lines,
    read_copies,
    read_work_items,
    shard_directories,
    token_counts,
)


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


def progress(work_dir: str) -> tuple[int, int]:
    """(requests finished, requests planned) of a job, read from its shards' checkpoints (for merging what
    a stopped run finished; status reads take the job store's counts)."""
    done = total = 0
    for directory in shard_directories(work_dir):
        total += count_lines(io.join(directory, INPUT_FILE)) + count_lines(io.join(directory, COPIES_FILE))
        done += count_lines(io.join(directory, RESULTS_FILE))
    return done, total


@dataclass(frozen=True)
class Checkpointed:
    """What a job's shards' checkpoints hold: requests with a result, and their tokens."""

    requests: int
    prompt_tokens: int
    completion_tokens: int


def checkpointed(work_dir: str) -> Checkpointed:
    """The results a job's shard checkpoints hold (whole lines; a torn last one is not a result), counted
    as the worker counts a shard's tokens: a v1 output's `num_*_tokens`, an OpenAI object's `usage`. What a
    resumed job keeps rather than generates again."""
    requests = prompt_tokens = completion_tokens = 0
    for directory in shard_directories(work_dir):
        results_path = io.join(directory, RESULTS_FILE)
        if not io.exists(results_path):
            continue
        with io.open_file(results_path, "r", encoding="utf-8") as handle:
            for _, payload in iter_result_lines(handle):
                prompt, completion = token_counts(json.loads(payload))
                requests += 1
                prompt_tokens += prompt
                completion_tokens += completion
    return Checkpointed(requests, prompt_tokens, completion_tokens)


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
