from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import dagster as dg

from batch_pipeline.shards import ShardTask

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
        if message.get("method") == "report_custom_message" and isinstance(payload, dict) and "progress" in payload:
            try:
                self._on_progress(payload["progress"])
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


def worker_stats(task: ShardTask, reports: Sequence[Any]) -> dict[str, Any]:
    """The stats a worker reports last, as its Pipes custom message."""
    if not reports:
        raise dg.Failure(f"shard {task.shard.shard_index}: the worker exited without reporting its stats")
    return reports[-1]


class ShardLauncher(dg.ConfigurableResource):
    """Runs the shard worker for one task through Dagster Pipes, wherever the deployment puts it.

    Implementations: `LocalShardLauncher` (a subprocess on this machine); a Kubernetes launcher replaces it
    in production. A launcher returns the worker's stats, and raises when the worker fails, so that the
    step's retry policy starts it again and it resumes from its checkpoint.
    """

    def run_shard(
        self, context: dg.OpExecutionContext, task: ShardTask, on_progress: ProgressCallback | None = None
    ) -> dict[str, Any]:
        raise NotImplementedError

    def shard_slots(self) -> int | None:
        """How many shard workers of one job can compute at once; None where the cluster decides (pods
        wait for nodes). A job is not split into more shards than this."""
        return None
