"""The warm engine pool on this machine: shard workers that stay alive after their shard, each keeping its
vLLM engine, for the local launcher to hand the next shard built for the same engine to.

`serve` makes the pool's directory (BATCH_PIPELINE_ENGINE_POOL_DIR, private to the service's user) and
removes it as it stops, which ends every worker in it. A shard's step claims a waiting worker whose engine
and environment match its own (`PoolKey`), or starts a new one into the pool; either way it hands the worker
its Pipes bootstrap, as the standby hand-off does, and waits for the shard's exit code, so that the step
keeps its progress, checkpoints, retries and resume. The worker's side, and the bound on waiting workers and
their memory, is worker/pool_worker.py; each worker's files are named in shards/protocol.py.

A `tool_config` shard runs sandboxed code whose traces a process could keep: its worker serves one team.
"""

from __future__ import annotations

import hashlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from batch_pipeline.core import io
from batch_pipeline.launch.standby import environment_digest, private_directory
from batch_pipeline.shards.protocol import (
    POOL_CLAIMED,
    POOL_IDLE,
    POOL_OUTPUT,
    POOL_OWNER,
    POOL_SHARD_EXIT,
    POOL_STARTED,
    STANDBY_HANDOFF,
    PoolShardExit,
    PoolWorkerStarted,
    ShardTask,
    StandbyHandoff,
    announced_workers,
    engine_key,
    is_pool_worker,
)

WAIT_POLL_S = 0.05
POOL_PREFIX = "batch_pipeline-engine-pool-"


@dataclass(frozen=True)
class PoolSize:
    """The deployment's bound on its pool (BATCH_PIPELINE_ENGINE_POOL_*)."""

    max_idle: int  # workers kept waiting at once; 0: no pool
    idle_s: float  # how long a worker waits for a shard before it leaves
    max_idle_memory_mib: int  # what the waiting workers may hold together; 0: no bound


@dataclass(frozen=True)
class PoolKey:
    """What a shard needs of a pool worker: the engine, the environment it was started in (torch reads its
    thread settings as it imports), and for a `tool_config` shard its team."""

    engine: str
    env_digest: str

    @classmethod
    def of(cls, task: ShardTask, worker_env: Mapping[str, str]) -> PoolKey | None:
        """The shard's key; None for a shard no warm engine may serve: one of a checkpoint on an object store,
        whose weights may change under the same URL (a warm engine would keep the old ones)."""
        key = engine_key(task.model_config)
        checkpoint = task.model_config.checkpoint_path
        if checkpoint:
            if not io.is_local(checkpoint):
                return None
            key = _digest(key, _local_weights(checkpoint))
        if task.tool_config is not None:
            key = _digest(key, f"team:{task.owner_team or ''}")
        return cls(key, environment_digest(worker_env))


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _local_weights(checkpoint: str) -> str:
    """What a local checkpoint holds now (each file's name, size and time): rewritten, it is another engine."""
    root = io.filesystem(checkpoint)[1]
    entries = []
    for directory, _, names in os.walk(root):
        for name in names:
            try:
                info = os.stat(os.path.join(directory, name))
            except OSError:
                continue
            entries.append(f"{os.path.relpath(os.path.join(directory, name), root)}:{info.st_size}:{info.st_mtime_ns}")
    return "\n".join(sorted(entries))


class PoolWorker:
    """The launcher's handle on the pool worker running its shard: waited for, signalled and killed as a
    `subprocess.Popen` is (a pidfd: it may not be the launcher's child, and a reused pid is never hit).
    Its hand-off's token is the one the worker's exit code must name."""

    def __init__(self, directory: str, pid: int, pidfd: int, warm: bool) -> None:
        self.directory = directory
        self.pid = pid
        self.warm = warm  # claimed waiting, its engine built for this shard's key
        self.token = uuid.uuid4().hex
        self._pidfd = pidfd
        self._code: int | None = None

    def hand_off(self, env: Mapping[str, str], log_path: str, key: PoolKey) -> None:
        handoff = StandbyHandoff(
            env=dict(env), log=log_path, launcher_pid=os.getpid(), token=self.token, pool_key=key.engine
        )
        with io.atomic_write(os.path.join(self.directory, STANDBY_HANDOFF)) as handle:
            handle.write(handoff.model_dump_json())

    def wait(self, timeout: float | None = None) -> int:
        """The shard's exit code, which the worker leaves as it finishes the shard, and waits for this
        launcher to read before it waits for another."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._code is None:
            gone = bool(select.select([self._pidfd], [], [], WAIT_POLL_S)[0])
            code = self._read_exit()
            if code is not None:
                self._code = code
            elif gone:
                self._code = -signal.SIGKILL  # it left no code: killed
            elif deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pool worker {self.pid}", timeout or 0)
        return self._code

    def _read_exit(self) -> int | None:
        path = os.path.join(self.directory, POOL_SHARD_EXIT)
        try:
            with open(path) as handle:
                exit = PoolShardExit.model_validate_json(handle.read())
        except (OSError, ValueError):
            return None
        if exit.token != self.token:  # not this launcher's shard: never read, never removed
            return None
        os.unlink(path)  # read: the worker may go on to wait for the next shard
        return exit.code

    def early_output(self, limit: int = 3000) -> str:
        try:
            return io.tail(os.path.join(self.directory, POOL_OUTPUT), limit)
        except OSError:
            return ""

    def send_signal(self, sig: int) -> None:
        if self._code is not None:  # its shard has ended: the worker may be another launcher's by now
            return
        try:
            signal.pidfd_send_signal(self._pidfd, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Done with it. A worker never handed a shard, or whose shard did not end well (killed, failed,
        stopped), is of no use to the pool: its directory goes with it."""
        if self._code is None:
            self.kill()
        if self._code != 0:
            shutil.rmtree(self.directory, ignore_errors=True)
        os.close(self._pidfd)


class EnginePool:
    """The pool's directory as a launcher uses it."""

    def __init__(self, directory: str, size: PoolSize) -> None:
        self.directory = directory
        self.size = size

    @classmethod
    def at(cls, directory: str, size: PoolSize) -> EnginePool | None:
        """The pool at `directory`, when there is one there that `serve` made (private to this user) and the
        deployment keeps workers in it."""
        if not directory or size.max_idle < 1 or not private_directory(directory):
            return None
        return cls(directory, size)

    def claim(self, key: PoolKey) -> PoolWorker | None:
        """A waiting worker of `key`, taken (a rename of its announcement: one launcher wins); None when
        none waits. The one that waited longest is taken, so the others' idle time runs out first."""
        waiting = sorted(
            (idle.idle_since, directory, started)
            for directory, idle, started in announced_workers(os.scandir(self.directory))
            if idle.engine_key == key.engine and started.env_digest == key.env_digest
        )
        for _, directory, started in waiting:
            try:
                os.rename(os.path.join(directory, POOL_IDLE), os.path.join(directory, POOL_CLAIMED))
            except FileNotFoundError:  # taken, or retired, just now
                continue
            worker = _open(directory, started.pid, warm=True)
            if worker is not None:
                return worker
            shutil.rmtree(directory, ignore_errors=True)  # killed while it waited
        return None

    def start(self, env: Mapping[str, str], python: str = "") -> PoolWorker:
        """A new worker into the pool, started in `env` (what a launched worker would get): it imports vLLM
        and builds its engine for the shard it is handed next."""
        directory = tempfile.mkdtemp(prefix="worker-", dir=self.directory)
        with open(os.path.join(directory, POOL_OUTPUT), "ab") as log:
            process = subprocess.Popen(
                [
                    python or sys.executable,
                    "-m",
                    "batch_pipeline.worker",
                    "--pool",
                    directory,
                    "--idle-s",
                    str(self.size.idle_s),
                    "--max-idle",
                    str(self.size.max_idle),
                    "--max-idle-memory-mib",
                    str(self.size.max_idle_memory_mib),
                ],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        with io.atomic_write(os.path.join(directory, POOL_STARTED)) as started:
            started.write(PoolWorkerStarted(pid=process.pid, env_digest=environment_digest(env)).model_dump_json())
        # Born claimed: one whose launcher dies before the hand-off leaves after the claim's timeout.
        with io.atomic_write(os.path.join(directory, POOL_CLAIMED)) as claimed:
            claimed.write(str(os.getpid()))
        return PoolWorker(directory, process.pid, os.pidfd_open(process.pid), warm=False)


def make_pool_directory() -> str:
    """A new pool's directory, private to this user (0700), for `serve` to name in its services' environment;
    its workers leave when this process does, however it ends."""
    _remove_orphaned_pools()
    directory = tempfile.mkdtemp(prefix=POOL_PREFIX)
    with io.atomic_write(os.path.join(directory, POOL_OWNER)) as owner:
        owner.write(str(os.getpid()))
    return directory


def _remove_orphaned_pools() -> None:
    """The pools of `serve`s killed before they could remove theirs (their workers have left with them)."""
    base = tempfile.gettempdir()
    for entry in os.scandir(base):
        if not entry.name.startswith(POOL_PREFIX) or not private_directory(entry.path):
            continue
        try:
            with open(os.path.join(entry.path, POOL_OWNER)) as handle:
                owner = int(handle.read())
        except (OSError, ValueError):
            continue
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            shutil.rmtree(entry.path, ignore_errors=True)
        except PermissionError:  # alive, as another user
            continue


def _open(directory: str, pid: int, warm: bool) -> PoolWorker | None:
    """A handle on worker `pid` of `directory`; None where that process is gone (its pid maybe reused)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    if not is_pool_worker(directory, pid) or select.select([pidfd], [], [], 0)[0]:
        os.close(pidfd)
        return None
    return PoolWorker(directory, pid, pidfd, warm)
