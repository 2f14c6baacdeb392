"""How a job is cut into shards: how many (no more than the work fills), and the writer that streams work
items into their inputs, balanced by estimated tokens, with repeats as copies of their source."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import IO

from batch_pipeline.core import io
from batch_pipeline.core.io import make_private_directory
from batch_pipeline.shards.format import COPIES_FILE, INPUT_FILE, RESULTS_FILE, ShardSpec, WorkItem
from batch_pipeline.shards.protocol import WORKER_WINDOW
from batch_pipeline.shards.records import ItemSize, output_limit, repeat_key, shared_generation_key
from batch_pipeline.shards.result_cache import CachedOutputs

# The rule write_shards keeps requests sharing a generation together by (its window, its balance): a plan
# records it, so a release that changes the rule gives it a new version and keeps this one for such plans.
GENERATION_GROUPING = 1

# Distinct deterministic requests remembered to find repeats (~120 MB of the planner's memory when full);
# past it, repeats of requests first seen later are generated again.
DEDUP_TABLE_LIMIT = 1_000_000
# The most items plan_shard_count reads ahead (held in memory) to count a job's tokens: requests its team's
# cache answers weigh none, and a job of hits alone would otherwise be read whole before its plan (a hit
# holds where its output is, not the output).
READ_AHEAD_LIMIT = 100_000


@dataclass(frozen=True)
class PlanningSettings:
    """How jobs are split: at most `max_shards` shards (None: no limit), each worth at least
    `min_tokens_per_shard` estimated tokens (0: any), repeats of deterministic requests generated once."""

    max_shards: int | None
    min_tokens_per_shard: int
    deduplicate: bool = True

    @classmethod
    def of_deployment(
        cls, max_shards_per_job: int | None, min_shard_tokens: int, deduplicate: bool, slots: int | None
    ) -> PlanningSettings:
        """A deployment's settings with a launcher that runs `slots` shards at once (None: no limit): its
        own cap on shards a job, unset, is the launcher's."""
        return cls(
            max_shards=max_shards_per_job or slots, min_tokens_per_shard=min_shard_tokens, deduplicate=deduplicate
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

    def to_dict(self) -> dict[str, int | str | None]:
        return asdict(self)


@dataclass(frozen=True)
class RecordedPlan:
    """The shard plan a job's first run made, as the job store keeps it (`batch_jobs.shard_plan`): its shard
    count, whether repeats were copies and whether requests sharing a generation were kept together. Every
    later run of the job (a retry, a resume) writes its shards from it, whatever the settings and this
    release's defaults say by then: `write_shards` puts the same items in the same shards for the same
    plan, so each checkpointed result still lies in its request's shard."""

    plan: ShardPlan
    deduplicate: bool
    # How requests sharing a generation were kept together: 0 not at all (every plan recorded before this
    # release), else the version of the rule (GENERATION_GROUPING) that placed them.
    generation_grouping: int = 0

    @property
    def group_generations(self) -> bool:
        """Whether write_shards groups as this plan was made: this release knows its own rule only."""
        if self.generation_grouping not in (0, GENERATION_GROUPING):
            raise ValueError(f"the job was planned by a later release (generation grouping {self.generation_grouping})")
        return self.generation_grouping == GENERATION_GROUPING

    def to_json(self) -> str:
        return json.dumps(
            {**self.plan.to_dict(), "deduplicate": self.deduplicate, "generation_grouping": self.generation_grouping}
        )

    @classmethod
    def from_json(cls, text: str) -> RecordedPlan:
        fields = json.loads(text)
        plan = ShardPlan(requested=int(fields["requested"]), used=int(fields["used"]), reason=fields.get("reason"))
        return cls(
            plan=plan,
            deduplicate=bool(fields["deduplicate"]),
            generation_grouping=int(fields.get("generation_grouping", 0)),
        )


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
            if tokens >= most * settings.min_tokens_per_shard or len(read_ahead) >= READ_AHEAD_LIMIT:
                break
        items = itertools.chain(read_ahead, items)
    used, reason = settings.shards_for(requested, tokens)
    return ShardPlan(requested=requested, used=used, reason=reason), items


def first_plan(
    items: Iterator[tuple[WorkItem, ItemSize]],
    requested: int,
    settings: PlanningSettings,
    tool_loop: bool,
    planned_before: bool,
) -> tuple[RecordedPlan, Iterator[tuple[WorkItem, ItemSize]]]:
    """The plan a job's first run makes, for the job store to keep for its later runs, and the items (those
    read ahead to count its shards included). `planned_before`: shards of the job are there already,
    written by a release that kept no plan."""
    plan, items = plan_shard_count(items, requested, settings)
    # A tool loop runs code whose output may change between runs: its requests are never merged.
    deduplicate = settings.deduplicate and not tool_loop
    # Shards without a kept plan were written by a release that kept none, and grouped nothing.
    grouping = GENERATION_GROUPING if deduplicate and not planned_before else 0
    return RecordedPlan(plan, deduplicate, generation_grouping=grouping), items


def describe_shards(shards: list[ShardSpec], plan: ShardPlan, work_dir: str, kept: bool) -> str:
    """The shards a run wrote, for its log; `kept`: as the job's first run planned them."""
    copies = sum(shard.copy_count for shard in shards)
    return (
        f"{sum(shard.item_count for shard in shards)} requests in {len(shards)} shards under {work_dir}: "
        + ", ".join(f"{shard.prompt_count} prompts (~{shard.estimated_tokens} tokens)" for shard in shards)
        + (f"; {copies} repeat an earlier deterministic request and take its output" if copies else "")
        + (f"; {plan.used} shards of the {plan.requested} asked: {plan.reason}" if plan.reason else "")
        + ("; the shard plan of the job's first run, kept so that its checkpoints line up" if kept else "")
    )


def write_shards(
    items: Iterable[tuple[WorkItem, ItemSize]],
    num_shards: int,
    work_dir: str,
    deduplicate: bool = False,
    group_generations: bool = False,
) -> list[ShardSpec]:
    """Stream items into `num_shards` shard inputs, each item to the least-loaded shard by estimated tokens.

    With `deduplicate`, a request that repeats an earlier deterministic one goes to its source's shard as a
    copy (copies.tsv), weighing nothing. With `group_generations`, a deterministic request that differs from
    one of the last WORKER_WINDOW items of a shard only in its output limit goes to that shard, where the
    worker answers both with one generation (worker/shared_generation.py): it weighs what it adds to the
    group's largest limit. A request the team's result cache answers (`WorkItem.cached`) goes to the
    least-loaded shard, weighing nothing, with its result, read from the cache's payload file now, in the
    shard's checkpoint; one whose payload turned unreadable since the lookup is generated. One pass; memory
    bounded by DEDUP_TABLE_LIMIT and the shards' windows. Shards with nothing to do are not returned.
    """
    with contextlib.ExitStack() as files:
        shards = open_shard_writers(work_dir, num_shards, files)
        cached_outputs = files.enter_context(CachedOutputs())
        repeats = RepeatSources(num_shards)
        groups = GenerationGroups(num_shards)
        loads = ShardLoads(shards)
        for item, size in items:
            key = repeat_key(item) if deduplicate else None
            source = repeats.source_of(key) if key is not None else None
            if source is not None:
                source_index, shard_index = source
                shards[shard_index].add_copy(item.index, source_index, size)
                continue
            if item.cached is not None:
                output = cached_outputs.output_of(item)
                if output is not None:
                    shard = loads.least_loaded()
                    shard.add_cached(item, size, output)
                    if key is not None:
                        repeats.remember(key, item.index, shard.index)
                    continue
                # Its payload was cut short, replaced or deleted since the lookup: a miss after all.
                size = ItemSize(prompts=size.prompts, tokens=item.cached.estimated_tokens)
                item = replace(item, cached=None)
            generation = shared_generation_key(item) if group_generations else None
            shard = balance_request(item, size, generation, groups, loads)
            shard.add_request(item, size)
            if key is not None:
                repeats.remember(key, item.index, shard.index)
    return shard_specs(shards)


def shard_directory(work_dir: str, shard: int) -> str:
    return io.join(work_dir, "shards", f"{shard:03d}")


class ShardWriter:
    """One shard as a plan writes it: its input, and its copies file once it has one, open until the plan is
    written (each then put in place whole), and its figures so far. `suffix` names the files it writes
    (a later run stages them beside the earlier ones)."""

    def __init__(self, index: int, directory: str, files: contextlib.ExitStack, suffix: str = "") -> None:
        self.index = index
        self.directory = directory
        self.items = 0  # outputs the shard owes, copies included
        self.copies = 0  # of items: repeats filled from their source's output
        self.cached = 0  # of items: answered from the team's result cache
        self.cached_prompt_tokens = 0
        self.cached_completion_tokens = 0
        self.prompts = 0
        self.estimated_tokens = 0
        self._files = files
        self._suffix = suffix
        io.makedirs(directory)
        self._input = files.enter_context(io.atomic_write(io.join(directory, INPUT_FILE + suffix)))
        self._copies: IO[str] | None = None
        self._results: IO[str] | None = None

    @property
    def lines(self) -> int:
        """The requests in its input so far: the worker's windows are counted in them."""
        return self.items - self.copies

    @property
    def has_copies_file(self) -> bool:
        return self._copies is not None

    def open_copies(self) -> IO[str]:
        """Its copies file, opened the first time (a shard with no copies has none)."""
        if self._copies is None:
            path = io.join(self.directory, COPIES_FILE + self._suffix)
            self._copies = self._files.enter_context(io.atomic_write(path))
        return self._copies

    def add_request(self, item: WorkItem, size: ItemSize) -> None:
        """A request its worker generates; what it weighs is the caller's to add (see ShardLoads)."""
        self._input.write(item.to_line() + "\n")
        self.items += 1
        self.prompts += size.prompts

    def add_cached(self, item: WorkItem, size: ItemSize, output: str) -> None:
        """A request whose result its team's cache holds: in the input, and its `output` (its entry, as
        `CachedOutputs` read it) in the checkpoint, which the worker skips as done."""
        assert item.cached is not None
        if self._results is None:
            self._results = self._files.enter_context(
                io.atomic_write(io.join(self.directory, RESULTS_FILE + self._suffix))
            )
        self.add_request(item, size)
        self._results.write(f"{item.index}\t{output}\n")
        self.cached += 1
        self.cached_prompt_tokens += item.cached.prompt_tokens
        self.cached_completion_tokens += item.cached.completion_tokens

    def add_copy(self, index: int, source: int, size: ItemSize) -> None:
        """Request `index`, answered by the output of request `source` in this shard."""
        self.open_copies().write(f"{index}\t{source}\n")
        self.copies += 1
        self.items += 1
        self.prompts += size.prompts

    def spec(self) -> ShardSpec:
        return ShardSpec(
            shard_index=self.index,
            directory=self.directory,
            item_count=self.items,
            prompt_count=self.prompts,
            estimated_tokens=self.estimated_tokens,
            copy_count=self.copies,
            cached_count=self.cached,
            cached_prompt_tokens=self.cached_prompt_tokens,
            cached_completion_tokens=self.cached_completion_tokens,
        )


def open_shard_writers(work_dir: str, count: int, files: contextlib.ExitStack, suffix: str = "") -> list[ShardWriter]:
    """Writers of the job's `count` shards, their directories made (private, on a local disk)."""
    directories = [shard_directory(work_dir, k) for k in range(count)]
    if io.is_local(work_dir):  # the job's prompts and outputs: for the worker's user alone
        for directory in [work_dir, io.join(work_dir, "shards"), *directories]:
            make_private_directory(directory)
    return [ShardWriter(k, directory, files, suffix) for k, directory in enumerate(directories)]


def shard_specs(shards: list[ShardWriter]) -> list[ShardSpec]:
    """The shards a plan wrote: those with something to do."""
    return [shard.spec() for shard in shards if shard.items]


class RepeatSources:
    """The deterministic requests a plan generates, by repeat key: the one a later repeat copies, and its
    shard. The first of each is kept, up to DEDUP_TABLE_LIMIT keys."""

    def __init__(self, shard_count: int) -> None:
        self._shard_count = shard_count
        self._sources: dict[int, int] = {}  # repeat key -> index * shard count + shard, the smallest to hold

    def source_of(self, key: int) -> tuple[int, int] | None:
        """The index and shard of the request a repeat of `key` copies; None for the first of its key."""
        source = self._sources.get(key)
        return None if source is None else divmod(source, self._shard_count)

    def remember(self, key: int, index: int, shard: int) -> None:
        if key not in self._sources and len(self._sources) < DEDUP_TABLE_LIMIT:
            self._sources[key] = index * self._shard_count + shard


@dataclass(frozen=True)
class _Group:
    """Requests one generation may answer, as planned so far: their shard, the input line of the last one
    there, and their largest output limit."""

    shard: ShardWriter
    last_line: int
    limit: int


class GenerationGroups:
    """The groups of requests sharing a generation, by shared generation key, least recent first: as many
    as the shards' windows hold, past which a request would be generated on its own anyway."""

    def __init__(self, shard_count: int) -> None:
        self._most = shard_count * WORKER_WINDOW
        self._groups: OrderedDict[int, _Group] = OrderedDict()

    def take(self, generation: int) -> _Group | None:
        """The group a request of `generation` may join, taken out until `put` back; None where none is
        within its shard's window."""
        group = self._groups.pop(generation, None)
        if group is not None and group.shard.lines - group.last_line >= WORKER_WINDOW:
            return None  # past the worker's window there: it would be generated on its own
        return group

    def put(self, generation: int, group: _Group) -> None:
        self._groups[generation] = group
        if len(self._groups) > self._most:
            self._groups.popitem(last=False)


class ShardLoads:
    """The shards by the estimated tokens given them: a heap of (tokens, shard index), least loaded first,
    whose stale entries (a shard since given more) are skipped."""

    def __init__(self, shards: list[ShardWriter]) -> None:
        self._shards = shards
        self._heap = [(shard.estimated_tokens, shard.index) for shard in shards]
        heapq.heapify(self._heap)

    def least_loaded(self) -> ShardWriter:
        heap = self._heap
        while heap[0][0] != self._shards[heap[0][1]].estimated_tokens:
            heapq.heappop(heap)
        return self._shards[heap[0][1]]

    def add(self, shard: ShardWriter, tokens: int) -> None:
        if tokens:
            shard.estimated_tokens += tokens
            heapq.heappush(self._heap, (shard.estimated_tokens, shard.index))


def balance_request(
    item: WorkItem, size: ItemSize, generation: int | None, groups: GenerationGroups, loads: ShardLoads
) -> ShardWriter:
    """The shard a request the plan generates goes to, its weight added there: the least-loaded shard, or
    the shard of the group it shares a `generation` with (None: it shares none), where its prompt is cached
    and its tokens come from the group's generation, so it weighs only what its limit adds to the group's.
    It joins the group unless that leaves more work there than it would be alone on the least-loaded shard
    (a sweep of long limits after short ones)."""
    limit = output_limit(item) or 0
    group = groups.take(generation) if generation is not None else None
    least = loads.least_loaded()
    extra = max(0, limit - group.limit) * size.prompts if group is not None else 0
    if group is not None and group.shard.estimated_tokens + extra <= least.estimated_tokens + size.tokens:
        shard, limit = group.shard, max(limit, group.limit)
        loads.add(shard, extra)
    else:
        shard = least
        loads.add(shard, size.tokens)
    if generation is not None:  # before the request is written: its line is the shard's next
        groups.put(generation, _Group(shard=shard, last_line=shard.lines, limit=limit))
    return shard
