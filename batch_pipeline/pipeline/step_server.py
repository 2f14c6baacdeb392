"""The server the local executor forks step processes from (multiprocessing's forkserver)."""

from __future__ import annotations

import multiprocessing
import os
import signal
from multiprocessing import forkserver

# What every step would import again: the executor's child side, this package's job and resources, and the
# instance's storage (SQLite locally, PostgreSQL in production). A launcher adds its own (`step_modules`).
PRELOAD_MODULES = [
    "dagster._core.executor.multiprocess",
    "batch_pipeline.pipeline.definitions",
    "dagster._core.storage.sqlite_storage",
    "dagster_postgres",
]


def start() -> None:
    """Start it now, so that its imports run beside the caller's own instead of at the run's first step."""
    multiprocessing.set_forkserver_preload(PRELOAD_MODULES)
    forkserver.ensure_running()


def stop() -> None:
    """Stop it: the next step starts a new one, in the environment of that moment."""
    # No public way; CPython's own tests stop it so. typeshed leaves the private method out of its stubs.
    forkserver._forkserver._stop()  # type: ignore[attr-defined]


def kill() -> None:
    """Stop it at once, when the command that started it exits after its run: it has no step left to fork,
    and its interpreter's teardown (~0.6 s with Dagster imported, 2 cores) held the command's output open
    for that long after the command itself had ended."""
    pid = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):  # it has exited, and been waited for
            pass
