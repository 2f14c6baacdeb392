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
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from batch_pipeline.core import io
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
from batch_pipeline.shards.planning import (
    PlanningSettings,
    RecordedPlan,
    RepeatSources,
    ShardWriter,
    describe_shards,
    first_plan,
    open_shard_writers,
    shard_directory,
    shard_specs,
    write_shards,
)
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


@dataclass(frozen=True)
class JobShards:
    """The shards a run of a job wrote, the plan they follow (`kept`: the job's first run's, as the job
    store keeps it), and what changed in its input since an earlier run (None: nothing, or no earlier run)."""

    shards: list[ShardSpec]
    recorded: RecordedPlan
    kept: bool
    input_changes: str | None = None

    @property
    def estimated_tokens(self) -> int:
        return sum(shard.estimated_tokens for shard in self.shards)

    @property
    def cached(self) -> int:
        """Its requests answered from the team's result cache (by this plan: a first one)."""
        return sum(shard.cached_count for shard in self.shards)

    @property
    def copies(self) -> int:
        """Its requests that repeat an earlier deterministic one and take its output."""
        return sum(shard.copy_count for shard in self.shards)

    def describe(self, work_dir: str) -> str:
        """The shards, for the run's log."""
        return describe_shards(self.shards, self.recorded.plan, work_dir, self.kept)


def write_job_shards(
    items: Iterator[tuple[WorkItem, ItemSize]],
    work_dir: str,
    kept: RecordedPlan | None,
    requested: int,
    settings: PlanningSettings,
    tool_loop: bool,
    cache_hits: Callable[[Iterator[tuple[WorkItem, ItemSize]]], Iterator[tuple[WorkItem, ItemSize]]] | None = None,
) -> JobShards:
    """A run's shards of a job, as the plan its first run recorded (`kept`) places them, else as a first
    plan of `requested` shards under `settings` does; over the shards an earlier run wrote, if any.

    `cache_hits` marks the items its team's result cache answers (`shards/result_cache.with_cache_hits`):
    looked up by the job's first plan only, before any shard of it exists. A later run finds the hits in
    their shards' checkpoints and keeps them as it keeps any checkpointed result."""
    planned_before = has_earlier_plan(work_dir)
    if cache_hits is not None and kept is None and not shard_directories(work_dir):
        items = cache_hits(items)
    recorded = kept
    if recorded is None:
        recorded, items = first_plan(items, requested, settings, tool_loop, planned_before)
    if planned_before:
        # The input file may have changed since: no checkpointed result is kept under a changed request.
        rewritten = rewrite_shards(items, recorded.plan.used, work_dir, deduplicate=recorded.deduplicate)
        return JobShards(rewritten.shards, recorded, kept is not None, rewritten.describe())
    shards = write_shards(
        items,
        recorded.plan.used,
        work_dir,
        deduplicate=recorded.deduplicate,
        group_generations=recorded.group_generations,
    )
    return JobShards(shards, recorded, kept is not None)


def rewrite_shards(
    items: Iterable[tuple[WorkItem, ItemSize]], num_shards: int, work_dir: str, deduplicate: bool
) -> Rewritten:
    """Write the job's shard inputs from `items` over the earlier run's, keeping each unchanged request in
    its shard and its checkpointed result, and dropping every result whose request changed or is gone."""
    count = max(num_shards, len(shard_directories(work_dir)))
    earlier = _EarlierPlan([shard_directory(work_dir, k) for k in range(count)])
    kept = bytearray()  # by index: 1 + the shard whose checkpoint keeps the request's result; 0 for none
    with contextlib.ExitStack() as files:
        shards = open_shard_writers(work_dir, count, files, suffix=STAGED_SUFFIX)
        for shard in shards:  # an earlier copies file is replaced, if emptied
            if io.exists(io.join(shard.directory, COPIES_FILE)):
                shard.open_copies()
        repeats = RepeatSources(count)
        for item, size in items:
            planned, same = earlier.compare(item)
            kept.append(planned.shard + 1 if planned is not None and same else 0)
            key = repeat_key(item) if deduplicate else None
            shard, source = _place_again(planned, same, key, kept, repeats, shards)
            if source is not None:
                shard.add_copy(item.index, source, size)
            else:
                shard.add_request(item, size)
                shard.estimated_tokens += size.tokens
                if key is not None:
                    repeats.remember(key, item.index, shard.index)
        removed = earlier.removed_from(len(kept))
    # Before the new inputs are in place: see the module's docstring.
    dropped = sum(_drop_results(shard.directory, shard.index, kept) for shard in shards)
    _put_staged_in_place(shards)
    return Rewritten(shard_specs(shards), earlier.unchanged, earlier.changed, earlier.added, removed, dropped)


class _EarlierPlan:
    """The requests an earlier run's plan wrote, read by index as a later run's input is read (a k-way merge
    of its shards' inputs and copies), each compared with the request now at its index; the tallies."""

    def __init__(self, directories: list[str]) -> None:
        self._sources = {entry.source for k, d in enumerate(directories) for entry in _planned_copies(d, k)}
        self._planned = heapq.merge(
            *(stream for k, d in enumerate(directories) for stream in (_planned_items(d, k), _planned_copies(d, k))),
            key=lambda entry: entry.index,
        )
        self._next = next(self._planned, None)
        self._source_digests: dict[int, int] = {}  # of its copies' sources, by index, as it planned them
        self.unchanged = self.changed = self.added = 0

    def compare(self, item: WorkItem) -> tuple[_Planned | None, bool]:
        """What the earlier plan wrote at the item's index (None: nothing, it is added), and whether that is
        the same request. Items come by ascending index."""
        while self._next is not None and self._next.index < item.index:
            self._next = next(self._planned, None)
        planned = self._next if self._next is not None and self._next.index == item.index else None
        if planned is None:
            self.added += 1
            return None, False
        digest = request_digest(item)
        if planned.source is None:
            if planned.index in self._sources and planned.digest is not None:
                self._source_digests[planned.index] = planned.digest
            same = planned.digest == digest
        else:  # a copy: the same request as its source was
            same = self._source_digests.get(planned.source) == digest
        self.unchanged += same
        self.changed += not same
        return planned, same

    def removed_from(self, count: int) -> int:
        """The requests it planned at index `count` and past: gone from the end of the input."""
        rest = self._planned if self._next is None else itertools.chain([self._next], self._planned)
        return len({entry.index for entry in rest if entry.index >= count})


def _place_again(
    planned: _Planned | None,
    same: bool,
    key: int | None,
    kept: bytearray,
    repeats: RepeatSources,
    shards: list[ShardWriter],
) -> tuple[ShardWriter, int | None]:
    """The shard a request goes to on a later run, and the request whose output it copies (None: it is
    generated): an unchanged one stays where it was planned, a copy still where its source is kept; a changed
    one is a copy of a repeat this plan generates, or else stays in its shard; an added one goes to the
    least-loaded shard."""
    if planned is not None and same:
        # A copy whose source changed answers its own request still: kept, and generated if need be.
        if planned.source is not None and _keeps(kept, planned.source, planned.shard):
            return shards[planned.shard], planned.source
        return shards[planned.shard], None
    repeated = repeats.source_of(key) if key is not None else None
    if repeated is not None:
        source, k = repeated
        return shards[k], source
    if planned is not None:
        return shards[planned.shard], None
    return min(shards, key=lambda shard: shard.estimated_tokens), None


def _put_staged_in_place(shards: list[ShardWriter]) -> None:
    for shard in shards:
        for name in (INPUT_FILE, *([COPIES_FILE] if shard.has_copies_file else [])):
            _move(io.join(shard.directory, name + STAGED_SUFFIX), io.join(shard.directory, name))


def _keeps(kept: bytearray, index: int, shard: int) -> bool:
    """Whether request `index` is unchanged and stays in `shard`, its result there kept."""
    return index < len(kept) and kept[index] == shard + 1


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
