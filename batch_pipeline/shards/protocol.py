"""What the orchestrator and a shard worker send each other: the ShardTask in; back, over Pipes, the
worker's messages (progress as it runs, then its stats, or its failure), each checked against this
release's fields."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, with_config
from pydantic.dataclasses import dataclass as pydantic_dataclass
from typing_extensions import TypedDict  # pydantic reads typing's TypedDict only from Python 3.12

from batch_pipeline.contract.model_config import BatchCompletionsModelConfig
from batch_pipeline.contract.records import describe_validation_error
from batch_pipeline.contract.requests import ToolConfig
from batch_pipeline.shards.format import ShardSpec

# The worker takes its shard's pending items this many at a time: it orders them, and shares generations
# among them, a window at a time, with at most this many in flight. The planner groups for it.
WORKER_WINDOW = 1024

# A worker started ahead of its shard (`python -m batch_pipeline.worker --standby DIR`, by `batch-pipeline run`)
# imports vLLM while the run validates and plans, then waits in DIR for the local launcher to hand it the
# shard. The files of DIR, a directory private to the service's user:
STANDBY_DIR_ENV = "BATCH_PIPELINE_STANDBY_WORKER"  # DIR, in the run's environment
STANDBY_STARTED = "standby.json"  # a StandbyStarted
STANDBY_CLAIMED = "claimed"  # created once (O_EXCL) by the one launcher that takes or dismisses the worker
STANDBY_HANDOFF = "handoff.json"  # a StandbyHandoff, written whole (a rename)
STANDBY_EXIT = "exit"  # the worker's exit code, written whole as it leaves (its launcher is not its parent)
STANDBY_OUTPUT = "standby.log"  # its output until it has a shard's log


class StandbyStarted(BaseModel):
    """The standby worker, as its starter wrote it down."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    pid: int
    env_digest: str  # of the environment it started in: only a shard whose worker would get the same takes it


class StandbyHandoff(BaseModel):
    """What the launcher hands a standby or pool worker: its shard's Pipes bootstrap environment, its log,
    and (to a pool worker, which is not its child) the launcher's pid, whose exit stops the shard."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    env: dict[str, str]
    log: str
    launcher_pid: int | None = None
    # To a pool worker: this hand-off's token, which its shard's exit names (no launcher reads another's),
    # and the key it waits under afterwards (the launcher's `PoolKey`: a tool_config shard's names its team).
    token: str | None = None
    pool_key: str | None = None


# A warm engine pool (`launch/pool.py`, BATCH_PIPELINE_ENGINE_POOL_DIR): each pool worker
# (`python -m batch_pipeline.worker --pool DIR`) waits in a directory of its own under the pool's, keeping
# its engine between shards. Its files, beside STANDBY_HANDOFF:
POOL_STARTED = "worker.json"  # a PoolWorkerStarted, by the launcher that started it
POOL_IDLE = "idle.json"  # a PoolWorkerIdle, by the worker: there while it waits for a shard
POOL_CLAIMED = "claimed.json"  # POOL_IDLE renamed by the one launcher that takes it (a rename: one wins)
POOL_RETIRED = "retired.json"  # POOL_IDLE renamed by whoever ends its wait (its idle time, an eviction)
POOL_BUSY = "busy.json"  # a PoolWorkerBusy while it runs a shard, for operators (and the chaos soak) to see which
POOL_SHARD_EXIT = "shard-exit"  # a PoolShardExit, written whole; its launcher removes it as it reads it
POOL_OUTPUT = "pool.log"  # its output between shards
POOL_OWNER = "owner"  # in the pool's own directory: the pid of the `serve` that made it, whose exit ends the pool
POOL_EVICTIONS = "evictions"  # in the pool's own directory: how many waiting workers were evicted, for /metrics


class PoolWorkerStarted(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    pid: int
    env_digest: str  # of the environment it started in (launch/standby.py:environment_digest)


class PoolWorkerBusy(BaseModel):
    """A pool worker on a shard: the shard's log (in the shard's directory), and the shards its engine
    served before (0: it was started for this one)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    log: str
    shards_before: int


class PoolShardExit(BaseModel):
    """How a pool worker's shard ended, for the launcher whose hand-off `token` names."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    token: str
    code: int


class PoolWorkerIdle(BaseModel):
    """A pool worker waiting for a shard, with the engine it keeps."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    engine_key: str  # `engine_key` of the model_config its engine was built for
    shards_served: int
    idle_since: float  # epoch seconds
    rss_bytes: int  # its memory as it went idle, for the pool's bound


def is_pool_worker(directory: str, pid: int) -> bool:
    """Whether `pid` is the live pool worker of `directory`: its command line names the directory (not a
    process that took the pid of one gone), and it has not exited."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            arguments = cmdline.read().split(b"\0")
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return os.fsencode(directory) in arguments and state not in ("Z", "X")


@dataclass(frozen=True)
class PoolGauges:
    """A pool as `/metrics` tells it: what waits in it now, and its evictions so far."""

    waiting_workers: int
    waiting_bytes: int
    evictions: int


def announced_workers(
    entries: Iterable[os.DirEntry[str]],
) -> Iterator[tuple[str, PoolWorkerIdle, PoolWorkerStarted]]:
    """The workers among a pool's `entries` that announce themselves waiting: each one's directory, its
    announcement and how it was started (alive or not: the caller asks `is_pool_worker`)."""
    for entry in entries:
        try:
            with open(os.path.join(entry.path, POOL_IDLE)) as handle:
                idle = PoolWorkerIdle.model_validate_json(handle.read())
            with open(os.path.join(entry.path, POOL_STARTED)) as handle:
                started = PoolWorkerStarted.model_validate_json(handle.read())
        except (OSError, ValueError):  # not a worker's, not waiting, or claimed just now
            continue
        yield entry.path, idle, started


def pool_gauges(directory: str) -> PoolGauges | None:
    """The figures of the pool at `directory` (read-only); None where there is none on this machine."""
    try:
        entries = list(os.scandir(directory)) if directory else None
    except OSError:
        entries = None
    if entries is None:
        return None
    waiting = [idle for path, idle, started in announced_workers(entries) if is_pool_worker(path, started.pid)]
    try:
        with open(os.path.join(directory, POOL_EVICTIONS)) as handle:
            evictions = int(handle.read())
    except (OSError, ValueError):
        evictions = 0
    return PoolGauges(len(waiting), sum(idle.rss_bytes for idle in waiting), evictions)


# Fields of model_config that shape the handlers or the deployment, never the engine: two shards differing
# only in these can run on one engine.
_NOT_ENGINE_SHAPING = frozenset(
    {
        "labels",
        "num_shards",
        "response_role",
        "chat_template",
        "tool_call_parser",
        "enable_auto_tool_choice",
        "served_model_name",  # the name outputs carry, not the engine's
        "disable_log_requests",
    }
)


def engine_key(model_config: BatchCompletionsModelConfig) -> str:
    """What an engine built for `model_config` is, as a digest: every field that may change the engine
    (the model, its checkpoint and revision, every engine argument, dtype, max length). A field counted here
    that did not matter costs a cold start; one left out would serve a shard on the wrong engine."""
    shaping = model_config.model_dump(mode="json", exclude_none=True, exclude=set(_NOT_ENGINE_SHAPING))
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()


class ShardHardware(TypedDict, total=False):
    """The hardware a request named (each field only where named): what a pod of the shard is sized by."""

    gpus: int
    gpu_type: str
    cpus: str | int | float
    memory: str | int | float
    storage: str | int | float


@pydantic_dataclass(frozen=True)  # validated as built too: a task holds its parts as their contract types
class ShardTask:
    """Everything a worker needs, as the orchestrator sends it: the request's parts in their contract types,
    sent as JSON (`to_dict`) and checked again as they arrive (`from_dict`)."""

    shard: ShardSpec
    model_config: BatchCompletionsModelConfig
    shard_count: int = 1  # shards of the job, this one included
    deadline: float | None = None  # epoch seconds; the job's max_runtime_sec
    job_id: str = ""
    # The team that owns the job in the job store (None: an admin's or the launchpad's job, of no team), as
    # the pipeline reads it there: never the request's labels or the run's tags, which the team writes.
    owner_team: str | None = None
    hardware: ShardHardware = field(default_factory=lambda: ShardHardware())
    labels: dict[str, str] = field(default_factory=dict)
    tool_config: ToolConfig | None = None
    # Deterministic requests that differ only in their output limit share one generation (see the worker's
    # shared_generation); off with the deployment's deduplication, and in a task of an earlier release.
    share_generations: bool = False

    def to_dict(self) -> dict[str, Any]:
        return cast(dict[str, Any], _SHARD_TASK.dump_python(self, mode="json", by_alias=True))

    def __setstate__(self, state: Mapping[str, object]) -> None:
        # Dagster keeps plan_shards' outputs pickled, and unpickling builds no dataclass: a task an older
        # release pickled (its parts as dicts) comes back in its contract types for a re-execution.
        checked = _SHARD_TASK.validate_python(state)
        object.__setattr__(self, "__dict__", {name: getattr(checked, name) for name in state})

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
    cut_from_longer: int = 0  # of this attempt's: answered by another's generation (the same request, a larger limit)
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    engine_start_s: float = 0.0
    # A worker started ahead (`--standby`): its import of torch and vLLM before the shard reached it, which a
    # launched worker's engine_start_s counts; 0 for a launched one.
    imported_ahead_s: float = 0.0
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
    # A pool worker's engine (`launch/pool.py`): whether the shard ran in the pool, whether it found the engine
    # built (warm), how many shards it had served before this one, and the start it saved (what building it
    # took); false, false, 0, 0 elsewhere.
    engine_pooled: bool = False
    engine_warm: bool = False
    engine_shards_before: int = 0
    engine_start_saved_s: float = 0.0

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


@dataclass(frozen=True)
class ProgressMessage:
    """A shard's running counts (absolute, not increments), sent as results reach its checkpoint."""

    figures: dict[str, int]
    kind: Literal["progress"] = "progress"


# A ProgressMessage figure (sent as 1, alone): the worker is building its engine; its reports after that one
# are of generation. A job's status read tells its phase by them (`store.progress.ShardPhase`).
ENGINE_STARTING = "engine_starting"


@dataclass(frozen=True)
class FailureMessage:
    """Why the worker is failing (e.g. a full disk under the checkpoint), sent just before it exits."""

    reason: str
    kind: Literal["failure"] = "failure"


@dataclass(frozen=True)
class StatsMessage:
    """What the worker did with its shard: its last message when it succeeds."""

    stats: ShardStats
    kind: Literal["stats"] = "stats"


WorkerMessage = ProgressMessage | FailureMessage | StatsMessage
_WORKER_MESSAGE: TypeAdapter[WorkerMessage] = TypeAdapter(Annotated[WorkerMessage, Field(discriminator="kind")])


def worker_message_payload(message: WorkerMessage) -> dict[str, Any]:
    """The message as the worker sends it (a Pipes custom message: JSON)."""
    return asdict(message)


def read_worker_message(payload: Any) -> WorkerMessage:
    """A worker's message as the orchestrator receives it, checked as ShardTask.from_dict checks a task (and
    stats as strictly as ShardStats.from_dict): ValueError naming the field for one of another release."""
    if isinstance(payload, dict) and payload.get("kind") == StatsMessage.kind and set(payload) == {"kind", "stats"}:
        return StatsMessage(ShardStats.from_dict(payload["stats"]))
    try:
        return _WORKER_MESSAGE.validate_python(payload)
    except ValidationError as exc:
        raise ValueError(f"not a worker message of this release: {describe_validation_error(exc)}") from None
