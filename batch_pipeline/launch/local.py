"""The local shard launcher: each shard's worker a subprocess on this machine, through Dagster Pipes, its own
output in the shard's worker.log and a share of the cores."""

from __future__ import annotations

import math
import os
import signal
import stat
import subprocess
import sys
import tempfile
from typing import Protocol

import dagster as dg
from dagster._core.storage.dagster_run import FINISHED_STATUSES
from pydantic import Field

from batch_pipeline.admission.hardware import InvalidHardware, kubernetes_quantity
from batch_pipeline.core import io
from batch_pipeline.core.environment import child_environment
from batch_pipeline.launch.base import (
    ForwardsProgress,
    ProgressCallback,
    ShardLauncher,
    ShardResult,
    raise_if_past_deadline,
    worker_failure,
    worker_stats,
)
from batch_pipeline.launch.kinds import LOCAL
from batch_pipeline.launch.pool import EnginePool, PoolKey, PoolSize
from batch_pipeline.launch.standby import claim_standby
from batch_pipeline.shards.protocol import ShardTask

# How often a step checks that its run has not ended without it (its run worker killed).
RUN_STATUS_CHECK_S = 2.0
WORKER_LOG = "worker.log"


def worker_log_path(task: ShardTask) -> str:
    """Where a shard worker's own output goes: beside its checkpoint when the work dir is local (private to
    the service's user), else in the local temporary directory."""
    if io.is_local(task.shard.directory):
        return os.path.join(io.filesystem(task.shard.directory)[1], WORKER_LOG)
    name = f"{task.job_id or 'job'}-shard{task.shard.shard_index:03d}-{WORKER_LOG}"
    return os.path.join(_private_temp_dir(), name)


def _private_temp_dir() -> str:
    """A directory of the temporary one that only the service's user can enter: a worker's log holds a team's
    prompts and errors, and in /tmp itself any local account could read it, or plant a link at its name."""
    path = os.path.join(tempfile.gettempdir(), f"batch_pipeline-{os.geteuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        return tempfile.mkdtemp(prefix="batch_pipeline-")  # another user's, or a link: one of our own instead
    return path


def worker_environment(task: ShardTask) -> dict[str, str]:
    """This process's environment as far as the shard's worker may have it (core/environment.py): the
    object store's credentials only when its shard or its checkpoint is on one."""
    remote = [path for path in (task.shard.directory, task.model_config.checkpoint_path) if path]
    return child_environment(os.environ, object_store=not all(io.is_local(path) for path in remote))


class WorkerProcess(Protocol):
    """A launched worker (`subprocess.Popen`) or the standby one it was handed to (`ClaimedStandby`)."""

    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


def _stop(process: WorkerProcess) -> None:
    """Let the worker stop cleanly (it keeps its checkpoint whole), then kill it if it does not."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()


class _TempFileMessageReader(ForwardsProgress, dg.PipesTempFileMessageReader):
    pass


class LocalShardLauncher(ShardLauncher):
    """The shard worker as a subprocess of the step, on this machine."""

    kind = LOCAL

    python_executable: str = Field(
        default="", description="Python that runs the worker; empty = the one running Dagster."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the worker.")
    concurrency: int | None = Field(
        default=None, ge=1, description="Shard workers run at once on this machine; None = one per core."
    )
    engine_pool_dir: str = Field(
        default="", description="The warm engine pool's directory, which `serve` makes; empty: no pool."
    )
    engine_pool_workers: int = Field(default=2, ge=0, description="Workers the pool keeps waiting; 0: no pool.")
    engine_pool_idle_s: float = Field(default=300.0, gt=0, description="How long a warm worker waits for a shard.")
    engine_pool_memory_mib: int = Field(
        default=8192, ge=0, description="What the waiting workers may hold together, in MiB; 0: unbounded."
    )

    def run_shard(
        self, context: dg.OpExecutionContext, task: ShardTask, on_progress: ProgressCallback | None = None
    ) -> ShardResult:
        reader = _TempFileMessageReader()
        reader.on_progress = on_progress
        worker_env = {**worker_environment(task), **self._cpu_share(task), **self.env}
        raise_if_past_deadline(task)  # before any worker is started or claimed for a shard that would only stop
        standby = None if self.python_executable else claim_standby(worker_env)
        pool = None if standby is not None else self._pool()
        pool_key = None if pool is None else PoolKey.of(task, worker_env)
        pooled = None if pool is None or pool_key is None else pool.claim(pool_key)
        try:
            # PipesSubprocessClient's own run, opened up: on a non-zero exit the worker's last report says why.
            log_path = worker_log_path(task)
            with (
                dg.open_pipes_session(
                    context=context,
                    context_injector=dg.PipesEnvContextInjector(),
                    message_reader=reader,
                    extras={"task": task.to_dict()},
                ) as session,
                open(log_path, "ab") as log,
            ):
                process: WorkerProcess
                if standby is not None:
                    standby.hand_off(session.get_bootstrap_env_vars(), log_path)
                    process = standby
                    context.log.info(
                        f"shard {task.shard.shard_index}: handed to the worker `batch-pipeline run` started ahead "
                        "(vLLM imported while the run was planned)"
                    )
                elif pool is not None and pool_key is not None:
                    pooled = pooled or pool.start(worker_env)
                    pooled.hand_off(session.get_bootstrap_env_vars(), log_path, pool_key)
                    process = pooled
                    context.log.info(
                        f"shard {task.shard.shard_index}: "
                        + (
                            f"handed to a warm worker of the engine pool (pid {pooled.pid}), its engine built"
                            if pooled.warm
                            else f"no warm engine of its kind in the pool: a pool worker started (pid {pooled.pid})"
                        )
                    )
                else:
                    # vLLM's and torch's own output goes to the log: the run's console shows the worker's reports
                    # (progress, the engine's dtype, failures), which come through Pipes.
                    process = subprocess.Popen(
                        [self.python_executable or sys.executable, "-m", "batch_pipeline.worker"],
                        env={**worker_env, **session.get_bootstrap_env_vars()},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                context.log.debug(f"shard {task.shard.shard_index}: the worker's output is in {log_path}")
                try:
                    returncode = self._wait(context, process, task)
                except dg.DagsterExecutionInterruptedError:  # the run was cancelled: let the worker stop cleanly
                    _stop(process)
                    raise
        finally:  # a standby never handed its shard (the session could not open) is killed, not left waiting
            for claimed in (standby, pooled):
                if claimed is not None:
                    claimed.close()
        reports = session.get_custom_messages()
        if returncode != 0:
            raise_if_past_deadline(task)
            failure = worker_failure(reports)
            output = io.tail(log_path)
            waited = standby or pooled
            if waited is not None and not output.strip():  # it died before it had the shard's log
                output = waited.early_output()
            raise dg.Failure(
                f"shard {task.shard.shard_index}: the worker failed: {failure or f'exit code {returncode}'}"
                + ("" if failure else f"; the end of its output ({log_path}):\n{output}")
            )
        return ShardResult(task=task, stats=worker_stats(task, reports))

    def _pool(self) -> EnginePool | None:
        """The deployment's warm engine pool, where `serve` made one (not for another Python's workers)."""
        if self.python_executable:
            return None
        size = PoolSize(self.engine_pool_workers, self.engine_pool_idle_s, self.engine_pool_memory_mib)
        return EnginePool.at(self.engine_pool_dir, size)

    def shard_slots(self) -> int:
        """Each worker holds a whole engine (~2.3 GiB for the catalog model on the CPU), and more workers
        than cores only share the same cores."""
        return self.concurrency or max(1, os.cpu_count() or 1)

    @staticmethod
    def _wait(context: dg.OpExecutionContext, process: WorkerProcess, task: ShardTask) -> int:
        """The worker's exit code. A killed run worker leaves its step processes running (they hold its
        forkserver open), and Dagster marks the run failed: the worker is then stopped, so that the run's
        retry resumes the shard from its checkpoint alone, not beside it."""
        while True:
            try:
                return process.wait(timeout=RUN_STATUS_CHECK_S)
            except subprocess.TimeoutExpired:
                # Ids only: a whole run (its config and tags) costs tens of ms to read while the engine computes.
                finished = dg.RunsFilter(run_ids=[context.run_id], statuses=list(FINISHED_STATUSES))
                if context.instance.get_run_ids(finished, limit=1):
                    _stop(process)
                    run = context.instance.get_run_by_id(context.run_id)
                    raise dg.Failure(
                        f"shard {task.shard.shard_index}: the run ended ({run.status.value if run else 'deleted'}) "
                        "while the shard ran; its worker was stopped, and a retry of the run resumes it from its "
                        "checkpoint"
                    ) from None

    def shard_charge(self, task: ShardTask) -> float:
        """The cores the shard's worker computes on (`_cores`)."""
        return float(self._cores(task))

    def _cores(self, task: ShardTask) -> int:
        """The cores the shard's worker gets: its share of this machine (split with the job's shards running
        beside it), or the whole cores its request's `cpus` asks for where that is more. A worker is bound by
        its thread count, to whole cores: a request asking for less than its share gets, and is charged,
        its share. More cores than the machine has cannot be given: refused, naming the field."""
        machine = os.cpu_count() or 1
        side_by_side = min(task.shard_count, self.shard_slots())
        share = max(1, machine // max(1, side_by_side))
        asked = task.hardware.get("cpus")
        if asked is None:
            return share
        try:
            whole = max(1, math.ceil(kubernetes_quantity("cpus", asked)[1]))
        except InvalidHardware as exc:
            raise dg.Failure(str(exc), allow_retries=False) from None
        if whole > machine:
            raise dg.Failure(
                f"cpus: {asked!r} is more than the {machine} cores of this machine, where the local launcher runs "
                "each shard's worker; ask for at most that many",
                allow_retries=False,
            )
        return max(share, whole)

    def _cpu_share(self, task: ShardTask) -> dict[str, str]:
        """Each worker computes on its cores (`_cores`): shards running side by side split the machine's
        instead of all computing on the same ones, and a request's `cpus` is held to.

        vLLM's CPU backend binds its threads to the same cores in every process; two engines so bound ran
        2.5x slower than two with one unbound thread each (measured: 64 prompts over 2 shards, 2 cores).
        """
        cores = self._cores(task)
        if cores >= (os.cpu_count() or 1):
            return {}  # the whole machine: the engine's own threads and binding
        return {"OMP_NUM_THREADS": str(cores), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
