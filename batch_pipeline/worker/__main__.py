"""The shard worker: `python -m batch_pipeline.worker`.

Launched by Dagster Pipes (a local subprocess or a Kubernetes pod), it reads its task from the Pipes
extras, reports progress as Pipes log lines and as progress messages (`shards.protocol.WorkerMessage`,
sent as Pipes custom messages; the orchestrator writes them into the job store), then its stats, or why it
failed, as the last message. Started by hand, `--task FILE` names a JSON task instead. Started ahead by
`batch-pipeline run` (`--standby DIR`, launch/standby.py), it imports vLLM first and takes its Pipes
bootstrap from the launcher's handoff. Started into a warm engine pool (`--pool DIR`, launch/pool.py), it
takes shard after shard that way, keeping its engine between them. It knows nothing of HTTP or of the job
store.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from typing import TYPE_CHECKING

from batch_pipeline.core import io
from batch_pipeline.core.process import exit_without_teardown
from batch_pipeline.core.settings import Settings, settings
from batch_pipeline.shards.protocol import STANDBY_EXIT, STANDBY_HANDOFF, STANDBY_OUTPUT, StandbyHandoff
from batch_pipeline.worker.engine import set_engine_environment
from batch_pipeline.worker.sandbox import SandboxSettings

if TYPE_CHECKING:
    from batch_pipeline.worker.engine import KeptEngine
    from batch_pipeline.worker.runner import ShardRunner

HANDOFF_POLL_S = 0.02
# The shard's runner, and with it its engine, lives until the process exits (exit_now): dropped when its
# shard ends, the engine's shutdown would collect the whole heap twice between the last result and the exit.
_RUNNERS: list[ShardRunner] = []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batch_pipeline.worker", description=__doc__)
    parser.add_argument("--task", help="a task JSON file, when not launched by Dagster Pipes")
    parser.add_argument(
        "--standby",
        metavar="DIR",
        help="import vLLM now, then wait in DIR for the local launcher to hand over a shard (batch-pipeline run)",
    )
    parser.add_argument(
        "--starter", type=int, help="with --standby: the pid of the batch-pipeline run whose exit ends the wait"
    )
    parser.add_argument(
        "--pool",
        metavar="DIR",
        help="import vLLM now, then run the shards launchers hand over in DIR, keeping the engine between them",
    )
    parser.add_argument("--idle-s", type=float, default=300.0, help="with --pool: how long to wait for a shard")
    parser.add_argument("--max-idle", type=int, default=1, help="with --pool: workers the pool keeps waiting")
    parser.add_argument(
        "--max-idle-memory-mib", type=int, default=0, help="with --pool: their memory together (0: unbounded)"
    )
    args = parser.parse_args(argv)
    configured = settings()  # a bad BATCH_PIPELINE_ value fails the shard now, naming it
    set_engine_environment()
    if args.pool:
        from batch_pipeline.worker.pool_worker import PoolLimits, serve_pool_shards

        limits = PoolLimits(args.idle_s, args.max_idle, args.max_idle_memory_mib * 2**20)
        return serve_pool_shards(
            args.pool,
            limits,
            lambda kept: _run_pipes_task(parser, configured, kept_engine=kept),
            import_engine=_import_engine,
            write_output_to=_write_output_to,
        )
    if args.standby:
        # Its parent by its own word: a parent that died before this line ran is no longer what getppid says.
        return _standby(args.standby, args.starter or os.getppid(), parser, configured)
    if args.task:
        from batch_pipeline.shards.protocol import ShardTask
        from batch_pipeline.worker.runner import ShardRunner

        with open(args.task) as handle:
            task = ShardTask.from_dict(json.load(handle))
        runner = ShardRunner(
            task,
            configured.checkpoint_upload_s,
            report=lambda line: print(line, file=sys.stderr, flush=True),
            sandbox_settings=sandbox_settings(configured),
        )
        _RUNNERS.append(runner)
        stats = runner.run()
        print(json.dumps(stats.to_dict()))
        return 0
    return _run_pipes_task(parser, configured)


def _run_pipes_task(
    parser: argparse.ArgumentParser,
    configured: Settings,
    imported_ahead_s: float = 0.0,
    kept_engine: KeptEngine | None = None,
) -> int:
    from dagster_pipes import (
        PipesContext,
        PipesDefaultContextLoader,
        PipesDefaultMessageWriter,
        PipesEnvVarParamsLoader,
    )

    from batch_pipeline.shards.protocol import (
        FailureMessage,
        ProgressMessage,
        ShardTask,
        StatsMessage,
        worker_message_payload,
    )
    from batch_pipeline.worker.runner import ShardRunner

    params = PipesEnvVarParamsLoader()
    if not params.is_dagster_pipes_process():
        parser.error("not launched by Dagster Pipes: pass --task FILE")
    # A context of its own, not open_dagster_pipes' process-wide one: a pool worker opens one per shard.
    with PipesContext(params, PipesDefaultContextLoader(), PipesDefaultMessageWriter()) as pipes:
        task = ShardTask.from_dict(pipes.get_extra("task"))
        prefix = f"shard {task.shard.shard_index:03d}: "
        try:
            runner = ShardRunner(
                task,
                configured.checkpoint_upload_s,
                report=lambda line: pipes.log.info(prefix + line),
                report_progress=lambda figures: pipes.report_custom_message(
                    worker_message_payload(ProgressMessage(figures))
                ),
                imported_ahead_s=imported_ahead_s,
                sandbox_settings=sandbox_settings(configured),
                kept_engine=kept_engine,
            )
            if kept_engine is None:
                _RUNNERS.append(runner)
            stats = runner.run()
        except Exception as exc:  # the step's failure message, e.g. a full disk under the checkpoint
            pipes.report_custom_message(worker_message_payload(FailureMessage(f"{type(exc).__name__}: {exc}")))
            raise
        pipes.report_custom_message(worker_message_payload(StatsMessage(stats)))
    return 0


def sandbox_settings(configured: Settings) -> SandboxSettings:
    return SandboxSettings(
        uid_base=configured.sandbox_uid_base,
        uids=configured.sandbox_uids,
        memory_mb=configured.sandbox_memory_mb,
        python=configured.sandbox_python,
        allow_network=configured.sandbox_allow_network,
    )


def _standby(directory: str, starter: int, parser: argparse.ArgumentParser, configured: Settings) -> int:
    """A worker started ahead of its shard: vLLM imported while the run validates and plans, then the shard
    the launcher hands over run as any Pipes worker's. Its exit code, whatever ends it, is left in
    `directory`: its launcher is not its parent, and cannot wait for it."""
    code = 1  # what an exception leaves
    try:
        started = time.monotonic()
        _import_engine()
        imported_ahead_s = round(time.monotonic() - started, 3)
        handoff = _wait_for_handoff(directory, starter)
        if handoff is None:
            code = 0
            return code
        _write_output_to(handoff.log, early_output=os.path.join(directory, STANDBY_OUTPUT))
        os.environ.update(handoff.env)  # the Pipes session's bootstrap
        code = _run_pipes_task(parser, configured, imported_ahead_s)
        return code
    except SystemExit as exc:  # parser.error's 2
        code = exc.code if isinstance(exc.code, int) else 1
        raise
    finally:
        if os.path.isdir(directory):  # its `batch-pipeline run`, gone, may have left it
            with io.atomic_write(os.path.join(directory, STANDBY_EXIT)) as exit_file:
                exit_file.write(str(code))


def _import_engine() -> None:
    """What building the engine imports first (torch, vLLM: ~5 s of its ~10 s on 2 cores), frozen out of
    garbage collection as `build_llm` freezes them."""
    gc.disable()
    try:
        from batch_pipeline.worker import runner, vllm_api

        vllm_api.LLM, vllm_api.PromptEngine, runner.ShardRunner  # noqa: B018 -- names resolved on first use
    finally:
        gc.freeze()
        gc.enable()


def _wait_for_handoff(directory: str, starter: int) -> StandbyHandoff | None:
    """The launcher's handoff: the Pipes bootstrap environment and the shard's log; None when
    `batch-pipeline run` (`starter`) is gone, killed before it could stop this worker: its directory goes
    too. (A launcher that has no use for this worker kills it.)"""
    path = os.path.join(directory, STANDBY_HANDOFF)
    while not os.path.exists(path):
        if os.getppid() != starter:
            shutil.rmtree(directory, ignore_errors=True)
            return None
        time.sleep(HANDOFF_POLL_S)
    with open(path) as handle:
        return StandbyHandoff.model_validate_json(handle.read())


def _write_output_to(log_path: str, early_output: str) -> None:
    """From now on, this process's output (vLLM's, torch's) goes to the shard's log, as a launched worker's
    does; what it wrote while it imported (`early_output`) goes there first."""
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with open(early_output, "rb") as early, os.fdopen(os.dup(log), "wb") as shard_log:
        shutil.copyfileobj(early, shard_log)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


def exit_now(code: int) -> None:
    """Leave without tearing down torch and an in-process vLLM engine (~3 s a shard): by now every result is
    fsynced and the stats are reported. An engine in its own processes (VLLM_ENABLE_V1_MULTIPROCESSING=1)
    gets vLLM's orderly shutdown instead, so none of them outlives the worker."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        sys.exit(code)
    exit_without_teardown(code)


if __name__ == "__main__":
    try:
        code = main()
    except KeyboardInterrupt:  # its run was cancelled: the launcher's SIGINT
        # Every finished result is fsynced and the checkpoint uploaded by now; the interpreter's teardown of
        # torch and the engine held a cancel ~25 s on 2 cores before the launcher killed the worker.
        code = 130
    exit_now(code)
