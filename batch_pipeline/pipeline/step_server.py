"""The server the local executor forks step processes from (multiprocessing's forkserver)."""

from __future__ import annotations

import multiprocessing
from multiprocessing import forkserver

# What every step would import again: the executor's child side, this package's job and resources, the
# instance's storage (SQLite locally, PostgreSQL in production), and the hardware checks' quantity parser
# (validate_input uses it wherever the operator bounds cpus, memory or storage, as the shipped k8s config does).
PRELOAD_MODULES = [
    "dagster._core.executor.multiprocess",
    "batch_pipeline.pipeline.definitions",
    "dagster._core.storage.sqlite_storage",
    "dagster_postgres",
    "kubernetes.utils.quantity",
]


def start() -> None:
    """Start it now, so that its imports run beside the caller's own instead of at the run's first step."""
    multiprocessing.set_forkserver_preload(PRELOAD_MODULES)
    forkserver.ensure_running()


def stop() -> None:
    """Stop it: the next step starts a new one, in the environment of that moment."""
    # No public way; CPython's own tests stop it so. typeshed leaves the private method out of its stubs.
    forkserver._forkserver._stop()  # type: ignore[attr-defined]
