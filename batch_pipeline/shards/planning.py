"""How a job is cut into shards: how many (no more than the work fills), and the writer that streams work
items into their inputs, balanced by estimated tokens, with repeats as copies of their source."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import IO

from batch_pipeline.core import io
from batch_pipeline.core.io import make_private_directory
from batch_pipeline.shards.format import COPIES_FILE, INPUT_FILE, ShardSpec, WorkItem
from batch_pipeline.shards.protocol import WORKER_WINDOW
from batch_pipeline.shards.records import ItemSize, output_limit, repeat_key, shared_generation_key

# The rule write_shards keeps requests sharing a generation together by (its window, its balance): a plan
# records it, so a release that changes the rule gives it a new version and keeps this one for such plans.
GENERATION_GROUPING = 1

# Distinct deterministic requests remembered to find repeats (~120 MB of the planner's memory when full);
# past it, repeats of requests first seen later are generated again.
DEDUP_TABLE_LIMIT = 1_000_000


@dataclass(frozen=True)
class _Group:
    """Requests one generation may answer, as planned so far: their shard, the input line of the last one
    there, and their largest output limit."""

    shard: int
    last_line: int
    limit: int


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
            if tokens >= most * settings.min_tokens_per_shard:
                break
        items = itertools.chain(read_ahead, items)
    used, reason = settings.shards_for(requested, tokens)
    return ShardPlan(requested=requested, used=used, reason=reason), items


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
    group's largest limit. One pass; memory bounded by DEDUP_TABLE_LIMIT and the shards' windows. Shards
    with nothing to do are not returned.
    """
    directories = [io.join(work_dir, "shards", f"{k:03d}") for k in range(num_shards)]
    loads = [(0, k) for k in range(num_shards)]  # heap of (estimated tokens assigned, shard); stale entries skipped
    item_counts = [0] * num_shards
    line_counts = [0] * num_shards  # of item_counts: those in the input, the worker's windows
    prompt_counts = [0] * num_shards
    token_counts = [0] * num_shards
    copy_counts = [0] * num_shards
    sources: dict[int, int] = {}  # repeat key -> index * num_shards + shard of its first request
    groups: OrderedDict[int, _Group] = OrderedDict()  # shared generation key -> its group, least recent first

    def least_loaded() -> int:
        while loads[0][0] != token_counts[loads[0][1]]:
            heapq.heappop(loads)
        return loads[0][1]

    def add_load(k: int, tokens: int) -> None:
        if tokens:
            token_counts[k] += tokens
            heapq.heappush(loads, (token_counts[k], k))

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
                generation = shared_generation_key(item) if group_generations else None
                limit = output_limit(item) or 0
                group = groups.pop(generation, None) if generation is not None else None
                if group is not None and line_counts[group.shard] - group.last_line >= WORKER_WINDOW:
                    group = None  # past the worker's window there: it would be generated on its own
                least = least_loaded()
                # In its group's shard its prompt is cached and its tokens come from the group's generation: it
                # adds only what its limit adds. It goes there unless that leaves more work there than it would
                # be alone on the least-loaded shard (a sweep of long limits after short ones).
                extra = max(0, limit - group.limit) * size.prompts if group is not None else 0
                if group is not None and token_counts[group.shard] + extra <= token_counts[least] + size.tokens:
                    k, limit = group.shard, max(limit, group.limit)
                    add_load(k, extra)
                else:
                    k = least
                    add_load(k, size.tokens)
                if generation is not None:
                    groups[generation] = _Group(shard=k, last_line=line_counts[k], limit=limit)
                    if len(groups) > num_shards * WORKER_WINDOW:  # past every shard's window: no longer joined
                        groups.popitem(last=False)
                writers[k].write(item.to_line() + "\n")
                line_counts[k] += 1
                if key is not None and len(sources) < DEDUP_TABLE_LIMIT:
                    sources[key] = item.index * num_shards + k
            item_counts[k] += 1
            prompt_counts[k] += size.prompts
    return shard_specs(directories, item_counts, prompt_counts, token_counts, copy_counts)


def shard_specs(
    directories: list[str],
    item_counts: list[int],
    prompt_counts: list[int],
    token_counts: list[int],
    copy_counts: list[int],
) -> list[ShardSpec]:
    """The shards a plan wrote, from its per-shard figures: those with something to do."""
    return [
        ShardSpec(
            shard_index=k,
            directory=directory,
            item_count=item_counts[k],
            prompt_count=prompt_counts[k],
            estimated_tokens=token_counts[k],
            copy_count=copy_counts[k],
        )
        for k, directory in enumerate(directories)
        if item_counts[k]
    ]
