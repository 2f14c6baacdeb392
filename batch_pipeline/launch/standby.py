"""A shard worker started ahead of its shard: `batch-pipeline run` starts one as it starts, and the local
launcher hands it the run's first shard instead of starting a fresh worker. The worker imports torch and
vLLM (~5 s of its ~10 s engine start on 2 cores) while the run starts, validates and plans (~3.8 s), so
that time is no longer paid before the engine's own.

Only a shard whose worker would get the same environment takes it (one shard of the run, its cores not
split with another's); any other is launched as before, and the launcher kills the standby, which would
only take cores from the launched ones. The worker's side is `python -m batch_pipeline.worker --standby DIR`.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from batch_pipeline.core import io
from batch_pipeline.core.environment import child_environment
from batch_pipeline.shards.protocol import (
    STANDBY_CLAIMED,
    STANDBY_DIR_ENV,
    STANDBY_EXIT,
    STANDBY_HANDOFF,
    STANDBY_OUTPUT,
    STANDBY_STARTED,
    StandbyHandoff,
    StandbyStarted,
)


def environment_digest(env: Mapping[str, str]) -> str:
    """What a worker's environment is, for comparing two without writing either (it may hold secrets)."""
    kept = sorted((name, value) for name, value in env.items() if name != STANDBY_DIR_ENV)
    return hashlib.sha256(json.dumps(kept).encode()).hexdigest()


@dataclass
class StartedStandby:
    """The standby worker as `batch-pipeline run`, its parent, holds it."""

    process: subprocess.Popen[bytes]
    directory: str

    @classmethod
    def start(cls) -> StartedStandby:
        """A standby worker in this process's environment as a worker may have it (core/environment.py; no
        object store's credentials: a shard that needs them launches its own worker), and that environment
        told where it waits (STANDBY_DIR_ENV), for the run's step processes to find it: call before they start."""
        directory = tempfile.mkdtemp(prefix="batch_pipeline-standby-")  # 0700
        env = child_environment(os.environ, object_store=False)
        with open(os.path.join(directory, STANDBY_OUTPUT), "ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "batch_pipeline.worker", "--standby", directory, "--starter", str(os.getpid())],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        with io.atomic_write(os.path.join(directory, STANDBY_STARTED)) as started:
            started.write(StandbyStarted(pid=process.pid, env_digest=environment_digest(env)).model_dump_json())
        os.environ[STANDBY_DIR_ENV] = directory
        return cls(process, directory)

    def stop(self) -> None:
        """Once the run has ended: a worker no shard took is killed; one that ran a shard has exited (its
        launcher waited for it), or is stopped as a launched worker is."""
        os.environ.pop(STANDBY_DIR_ENV, None)
        if self.process.poll() is None:
            if _handed_a_shard(self.directory):
                self.process.send_signal(signal.SIGINT)
                try:
                    self.process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    self.process.kill()
            else:
                self.process.kill()
            self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


class ClaimedStandby:
    """The launcher's handle on the standby worker it took: waited for, signalled and killed as a
    `subprocess.Popen` is, though it is not the launcher's child (a pidfd, so a reused pid is never hit)."""

    def __init__(self, directory: str, pid: int, pidfd: int) -> None:
        self.directory = directory
        self.pid = pid
        self._pidfd = pidfd
        self._handed_off = False

    def hand_off(self, env: Mapping[str, str], log_path: str) -> None:
        """Give the worker its shard: the Pipes session's bootstrap environment, and where its output goes."""
        _write_handoff(self.directory, StandbyHandoff(env=dict(env), log=log_path))
        self._handed_off = True

    def early_output(self, limit: int = 3000) -> str:
        """The end of what it wrote before it had the shard's log: why it died, if it died importing."""
        try:
            return io.tail(os.path.join(self.directory, STANDBY_OUTPUT), limit)
        except OSError:
            return ""

    def wait(self, timeout: float | None = None) -> int:
        ready, _, _ = select.select([self._pidfd], [], [], timeout)
        if not ready:
            raise subprocess.TimeoutExpired(f"standby worker {self.pid}", timeout or 0)
        return self.returncode()

    def returncode(self) -> int:
        """The code the worker left as it exited; a worker that left none was killed."""
        try:
            with open(os.path.join(self.directory, STANDBY_EXIT)) as handle:
                return int(handle.read())
        except (OSError, ValueError):
            return -signal.SIGKILL

    def send_signal(self, sig: int) -> None:
        try:
            signal.pidfd_send_signal(self._pidfd, sig)
        except ProcessLookupError:  # it has exited
            pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Done with it: a worker never handed its shard (the step failed before) is killed, not left waiting."""
        if not self._handed_off:
            self.kill()
        os.close(self._pidfd)


def claim_standby(worker_env: Mapping[str, str]) -> ClaimedStandby | None:
    """The standby worker of this run, when there is one, no other shard has taken it, and it started in the
    environment `worker_env` (what a launched worker would get, torch's thread settings included: they are
    read as it imports). A standby in another environment is killed; None: launch a worker."""
    directory = worker_env.get(STANDBY_DIR_ENV)
    if not directory or not private_directory(directory):
        return None
    try:
        with open(os.path.join(directory, STANDBY_STARTED)) as handle:
            started = StandbyStarted.model_validate_json(handle.read())
        os.close(os.open(os.path.join(directory, STANDBY_CLAIMED), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except (OSError, ValueError):  # taken by another shard, or its run has ended (ValidationError: a ValueError)
        return None
    try:
        pidfd = os.pidfd_open(started.pid)
    except (OSError, AttributeError):  # gone; or no pidfds here (a seccomp profile, not Linux): launch one
        return None
    standby = ClaimedStandby(directory, started.pid, pidfd)
    if started.env_digest != environment_digest(worker_env):
        standby.close()  # a worker that imported torch with other thread settings: of no use to this run
        return None
    if select.select([pidfd], [], [], 0)[0]:  # it has already exited (it could not import vLLM): launch one
        standby.close()
        return None
    return standby


def private_directory(directory: str) -> bool:
    """Whether `directory` is one `StartedStandby.start` (or `serve`, a pool's) made: a directory (no link) of
    this user's, 0700."""
    try:
        status = os.lstat(directory)
    except OSError:
        return False
    return stat.S_ISDIR(status.st_mode) and status.st_uid == os.geteuid() and not status.st_mode & 0o077


def _handed_a_shard(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, STANDBY_HANDOFF))


def _write_handoff(directory: str, handoff: StandbyHandoff) -> None:
    with io.atomic_write(os.path.join(directory, STANDBY_HANDOFF)) as handle:
        handle.write(handoff.model_dump_json())
