"""A job's shards written again by a later run of it (a retry, a resume), from its input as it reads now,
against the shards an earlier run wrote and the results their workers checkpointed.

An input file may have changed in between (a local file or an object rewritten; inline content is stored
and cannot), so every request is compared, at its index, with the one the earlier plan wrote there (by
`request_digest`; a copy's is its source's):
- unchanged, it stays in its shard, a copy of its source where that is unchanged too, and its checkpointed
  result is kept: it is not generated again;
- changed, its result is dropped and it is generated again in its shard, or, where it repeats a
  deterministic request this plan generates, it takes that one's output as a copy;
- added at the end, it goes to the least-loaded shard; gone from the end, its result is dropped.
Never an old answer under a changed request. Requests are matched by position: a record inserted or
removed mid-file moves every later request to another index, and those are generated again.

The new shard inputs are written beside the earlier ones (STAGED_SUFFIX), the results filtered, and only
then the new inputs moved into place: a run stopped before that finds the earlier inputs and compares
against them again (dropping a result twice drops nothing more); one stopped while they move finds results
that answer both. On an object store, where a write stopped midway may still publish what it wrote, no
half-written input ever stands beside results it does not match.
One pass over the input; the earlier plan is read as a k-way merge by index; memory holds a byte per
request, the earlier copies' sources, and the repeats table write_shards also holds.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO

from batch_pipeline.core import io
from batch_pipeline.core.io import make_private_directory
from batch_pipeline.shards.format import (
    COPIES_FILE,
    INPUT_FILE,
    OUTPUT_FILE,
    RESULTS_FILE,
    ShardSpec,
    WorkItem,
    iter_result_lines,
    read_work_items,
    shard_directories,
)
from batch_pipeline.shards.planning import DEDUP_TABLE_LIMIT, shard_specs
from batch_pipeline.shards.records import ItemSize, repeat_key, request_digest

# The new shard files are written under their names with this suffix, and moved over the earlier ones once
# the results that answer neither are dropped.
STAGED_SUFFIX = ".next"


@dataclass(frozen=True)
class Rewritten:
    """The shards a later run wrote, and how its input compared with the earlier plan's."""

    shards: list[ShardSpec]
    unchanged: int
    changed: int
    added: int
    removed: int
    results_dropped: int  # checkpointed results that answered a request no longer at their index

    def describe(self) -> str | None:
        """What changed in the input since the earlier plan, for the run's log; None when nothing did."""
        if not (self.changed or self.added or self.removed):
            return None
        return (
            f"the input changed since the job's earlier run: {self.changed} requests differ, {self.added} were "
            f"added and {self.removed} removed at the end; {self.results_dropped} checkpointed results answered "
            f"requests no longer there and were dropped, and those requests are generated again; "
            f"{self.unchanged} unchanged requests keep their checkpointed results"
        )


@dataclass(frozen=True)
class _Planned:
    """A request the earlier plan wrote: its index and shard, and its digest, or the source it copies."""

    index: int
    shard: int
    digest: int | None = None
    source: int | None = None


def has_earlier_plan(work_dir: str) -> bool:
    """Whether an earlier run of the job wrote shard inputs that a later run must be compared with. (A
    checkpoint with no input beside it, as an earlier pod uploaded it before this job's first plan, is kept by
    index as a first plan keeps it: the work dir is the service's, no team writes there.)"""
    return any(io.exists(io.join(directory, INPUT_FILE)) for directory in shard_directories(work_dir))


def rewrite_shards(
    items: Iterable[tuple[WorkItem, ItemSize]], num_shards: int, work_dir: str, deduplicate: bool
) -> Rewritten:
    """Write the job's shard inputs from `items` over the earlier run's, keeping each unchanged request in
    its shard and its checkpointed result, and dropping every result whose request changed or is gone."""
    count = max(num_shards, len(shard_directories(work_dir)))
    directories = [io.join(work_dir, "shards", f"{k:03d}") for k in range(count)]
    sources = {entry.source for k, directory in enumerate(directories) for entry in _planned_copies(directory, k)}
    planned = heapq.merge(
        *(stream for k, d in enumerate(directories) for stream in (_planned_items(d, k), _planned_copies(d, k))),
        key=lambda entry: entry.index,
    )
    source_digests: dict[int, int] = {}  # of the earlier plan's copies' sources, by index, as it planned them
    kept = bytearray()  # by index: 1 + the shard whose checkpoint keeps the request's result; 0 for none
    generated: dict[int, int] = {}  # repeat key -> index * count + shard of a request this plan generates
    item_counts, prompt_counts, token_counts, copy_counts = ([0] * count for _ in range(4))
    unchanged = changed = added = 0
    if io.is_local(work_dir):
        for directory in [work_dir, io.join(work_dir, "shards"), *directories]:
            make_private_directory(directory)
    with contextlib.ExitStack() as stack:
        inputs = []
        for directory in directories:
            io.makedirs(directory)
            inputs.append(stack.enter_context(io.atomic_write(io.join(directory, INPUT_FILE + STAGED_SUFFIX))))
        copy_writers: dict[int, IO[str]] = {}

        def copies_of(k: int) -> IO[str]:
            if k not in copy_writers:
                staged = io.join(directories[k], COPIES_FILE + STAGED_SUFFIX)
                copy_writers[k] = stack.enter_context(io.atomic_write(staged))
            return copy_writers[k]

        for k, directory in enumerate(directories):  # an earlier copies file is replaced, if emptied
            if io.exists(io.join(directory, COPIES_FILE)):
                copies_of(k)
        before = next(planned, None)
        for item, size in items:
            while before is not None and before.index < item.index:
                before = next(planned, None)
            earlier = before if before is not None and before.index == item.index else None
            digest = request_digest(item)
            same = False
            if earlier is None:
                added += 1
            elif earlier.source is None:
                if earlier.index in sources and earlier.digest is not None:
                    source_digests[earlier.index] = earlier.digest
                same = earlier.digest == digest
            else:
                same = source_digests.get(earlier.source) == digest
            unchanged += same
            changed += earlier is not None and not same
            key = repeat_key(item) if deduplicate else None
            source: int | None = None
            if earlier is not None and same:
                k = earlier.shard
                kept.append(k + 1)
                # A copy whose source changed answers its own request still: kept, and generated if need be.
                if earlier.source is not None and _keeps(kept, earlier.source, k):
                    source = earlier.source
            else:
                kept.append(0)
                if key is not None and key in generated:
                    source, k = divmod(generated[key], count)
                elif earlier is not None:
                    k = earlier.shard
                else:
                    k = min(range(count), key=lambda shard: token_counts[shard])
            if source is not None:
                copies_of(k).write(f"{item.index}\t{source}\n")
                copy_counts[k] += 1
            else:
                inputs[k].write(item.to_line() + "\n")
                token_counts[k] += size.tokens
                if key is not None and key not in generated and len(generated) < DEDUP_TABLE_LIMIT:
                    generated[key] = item.index * count + k
            item_counts[k] += 1
            prompt_counts[k] += size.prompts
        removed = len({entry.index for entry in _rest(before, planned) if entry.index >= len(kept)})
    # Before the new inputs are in place: see the module's docstring.
    dropped = sum(_drop_results(directory, k, kept) for k, directory in enumerate(directories))
    for k, directory in enumerate(directories):
        for name in (INPUT_FILE, *([COPIES_FILE] if k in copy_writers else [])):
            _move(io.join(directory, name + STAGED_SUFFIX), io.join(directory, name))
    shards = shard_specs(directories, item_counts, prompt_counts, token_counts, copy_counts)
    return Rewritten(shards, unchanged, changed, added, removed, dropped)


def _keeps(kept: bytearray, index: int, shard: int) -> bool:
    """Whether request `index` is unchanged and stays in `shard`, its result there kept."""
    return index < len(kept) and kept[index] == shard + 1


def _rest(head: _Planned | None, planned: Iterator[_Planned]) -> Iterator[_Planned]:
    if head is not None:
        yield head
    yield from planned


def _planned_items(directory: str, shard: int) -> Iterator[_Planned]:
    path = io.join(directory, INPUT_FILE)
    if io.exists(path):
        for item in read_work_items(path):
            yield _Planned(item.index, shard, digest=request_digest(item))


def _planned_copies(directory: str, shard: int) -> Iterator[_Planned]:
    path = io.join(directory, COPIES_FILE)
    if not io.exists(path):
        return
    with io.open_file(path, "r", encoding="utf-8") as handle:
        for line in handle:
            index, _, source = line.partition("\t")
            yield _Planned(int(index), shard, source=int(source))


def _move(source: str, target: str) -> None:
    """Put a staged file in its place: a rename locally, a copy and a delete on an object store."""
    fs, resolved = io.filesystem(source)
    fs.mv(resolved, io.filesystem(target)[1])


def _drop_results(directory: str, shard: int, kept: bytearray) -> int:
    """Drop from a shard's checkpoint every result not kept there; how many were dropped. Its sorted
    output, written from the checkpoint, goes with them: the worker writes it again."""
    path = io.join(directory, RESULTS_FILE)
    if not io.exists(path):
        return 0
    with io.open_file(path, "r", encoding="utf-8") as handle:
        dropped = sum(not _keeps(kept, index, shard) for index, _ in iter_result_lines(handle))
    if dropped:
        with io.open_file(path, "r", encoding="utf-8") as handle, io.atomic_write(path) as results:
            for index, payload in iter_result_lines(handle):
                if _keeps(kept, index, shard):
                    results.write(f"{index}\t{payload}\n")
        io.remove(io.join(directory, OUTPUT_FILE))
    return dropped
