"""What every shard launcher shares: the resource's interface, the shard's result (the worker's stats,
checked against this release's), and Pipes progress forwarded to the job store as it arrives."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import dagster as dg

from batch_pipeline.launch.kinds import LauncherKind
from batch_pipeline.shards.protocol import (
    FailureMessage,
    ProgressMessage,
    ShardStats,
    ShardTask,
    StatsMessage,
    read_worker_message,
)

# A worker's running counts (requests_done, errors, prompt_tokens, completion_tokens), as it reports them.
ProgressCallback = Callable[[dict[str, int]], None]
logger = logging.getLogger(__name__)


def raise_if_past_deadline(task: ShardTask) -> None:
    """A worker stopped by the job's deadline must not be retried: a retry would only stop again."""
    if task.deadline is not None and time.time() >= task.deadline:
        raise dg.Failure(
            f"max_runtime_sec exceeded: shard {task.shard.shard_index} was stopped at the job's deadline; "
            "its finished results are kept",
            allow_retries=False,
        )


class _ProgressHandler:
    """A Pipes message handler that hands each progress report to a callback as it arrives (on the
    reader's thread) and everything else to Dagster's handler."""

    def __init__(self, handler: Any, on_progress: ProgressCallback) -> None:
        self._handler = handler
        self._on_progress = on_progress

    def handle_message(self, message: Any) -> None:
        payload = (message.get("params") or {}).get("payload") if isinstance(message, dict) else None
        if (
            message.get("method") == "report_custom_message"
            and isinstance(payload, dict)
            and payload.get("kind") == ProgressMessage.kind
        ):
            try:
                report = read_worker_message(payload)
                assert isinstance(report, ProgressMessage)
                self._on_progress(report.figures)
            except Exception:  # a progress figure never fails a shard
                logger.warning("could not record a shard's progress", exc_info=True)
            return
        self._handler.handle_message(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handler, name)


class ForwardsProgress:
    """Mixed into a Pipes message reader: the worker's progress reports go to `on_progress` as they
    arrive, not only when the worker ends."""

    on_progress: ProgressCallback | None = None

    @contextlib.contextmanager
    def read_messages(self, handler: Any) -> Iterator[Any]:
        wrapped = _ProgressHandler(handler, self.on_progress) if self.on_progress else handler
        with super().read_messages(wrapped) as params:  # type: ignore[misc]
            yield params


class ShardPlacement(Protocol):
    """Where a launcher ran a shard's worker, as that launcher tells it (the Kubernetes launcher's pod,
    `launch.k8s.PodHardware`): what it adds to the shard's entry in the job's metadata file."""

    def metadata_entry(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ShardResult:
    """A shard done: the task its worker ran, the stats it reported, and where it ran as its launcher tells
    it (None: nothing to tell)."""

    task: ShardTask
    stats: ShardStats
    where: ShardPlacement | None = None

    def metadata_entry(self) -> dict[str, Any]:
        """The shard's entry in the job's metadata file: what each shard ran on is part of it."""
        entry = self.stats.to_dict()
        if self.where is not None:
            entry |= self.where.metadata_entry()
        return entry

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Dagster keeps run_shard's outputs pickled: a result an earlier release pickled named its pod `pod`.
        state = dict(state)
        if "pod" in state:
            state["where"] = state.pop("pod")
        self.__dict__.update(state)


if not TYPE_CHECKING:  # hidden from mypy, which would take every name of this module for one that exists

    def __getattr__(name: str) -> Any:
        # Where an earlier release's pickled results look for their pod's class (launch.k8s's now).
        if name == "PodHardware":
            from batch_pipeline.launch.k8s import PodHardware

            return PodHardware
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def worker_stats(task: ShardTask, reports: Sequence[Any]) -> ShardStats:
    """The stats a worker reports last, as its Pipes custom message, checked against this release's."""
    if not reports:
        raise dg.Failure(f"shard {task.shard.shard_index}: the worker exited without reporting its stats")
    try:
        last = read_worker_message(reports[-1])
    except ValueError as exc:  # a worker of another release: a retry would report the same
        raise dg.Failure(f"shard {task.shard.shard_index}: {exc}", allow_retries=False) from None
    if not isinstance(last, StatsMessage):
        raise dg.Failure(
            f"shard {task.shard.shard_index}: the worker's last message was its {last.kind}, not its stats"
        )
    return last.stats


def worker_failure(reports: Sequence[Any]) -> str | None:
    """The reason a worker gave for failing, from its messages (the last such), if it gave one."""
    for payload in reversed(reports):
        if isinstance(payload, dict) and payload.get("kind") == FailureMessage.kind:
            try:
                message = read_worker_message(payload)
            except ValueError:
                continue
            if isinstance(message, FailureMessage):
                return message.reason
    return None


class ShardLauncher(dg.ConfigurableResource):
    """Runs the shard worker for one task through Dagster Pipes, wherever the deployment puts it.

    Implementations: `LocalShardLauncher` (a subprocess on this machine); a Kubernetes launcher replaces it
    in production. A launcher returns the shard's result (the worker's stats), and raises when the worker
    fails, so that the step's retry policy starts it again and it resumes from its checkpoint.
    """

    # Which of the deployment's launchers it is, and so what it takes (a worker started ahead): each says its own.
    kind: ClassVar[LauncherKind]

    def run_shard(
        self, context: dg.OpExecutionContext, task: ShardTask, on_progress: ProgressCallback | None = None
    ) -> ShardResult:
        raise NotImplementedError

    def shard_charge(self, task: ShardTask) -> float | None:
        """What this launcher gives the shard's worker, in the units fair share and usage charge it by (GPUs,
        else cores): what it could use, whatever fraction the request declared. Raises dg.Failure for a size
        it cannot give. None: it cannot say; the shard is charged what its request asks, at least one."""
        return None

    def shard_slots(self) -> int | None:
        """How many shard workers of one job can compute at once; None where the cluster decides (pods
        wait for nodes). A job is not split into more shards than this."""
        return None

    def worker_image(self) -> str | None:
        """The image its workers run (their vLLM and torch), where it is not this machine's environment."""
        return None

    def step_modules(self) -> list[str]:
        """What this launcher's steps import beyond the job's definitions, for the step server to import
        once a run instead of each step (`pipeline.step_server`)."""
        return []
