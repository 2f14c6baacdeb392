"""The shard worker: `python -m batch_pipeline.worker`.

Launched by Dagster Pipes (a local subprocess or a Kubernetes pod), it reads its task from the Pipes
extras, reports progress as Pipes log lines and as progress messages (`shards.protocol.WorkerMessage`,
sent as Pipes custom messages; the orchestrator writes them into the job store), then its stats, or why it
failed, as the last message. Started by hand,
`--task FILE` names a JSON task instead. It knows nothing of HTTP or of the job store.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from batch_pipeline.core.process import exit_without_teardown
from batch_pipeline.core.settings import settings
from batch_pipeline.worker.engine import set_engine_environment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batch_pipeline.worker", description=__doc__)
    parser.add_argument("--task", help="a task JSON file, when not launched by Dagster Pipes")
    args = parser.parse_args(argv)
    settings()  # a bad BATCH_PIPELINE_ value fails the shard now, naming it
    set_engine_environment()

    from dagster_pipes import PipesEnvVarParamsLoader, open_dagster_pipes

    from batch_pipeline.shards.protocol import (
        FailureMessage,
        ProgressMessage,
        ShardTask,
        StatsMessage,
        worker_message_payload,
    )
    from batch_pipeline.worker.runner import ShardRunner

    if args.task:
        with open(args.task) as handle:
            task = ShardTask.from_dict(json.load(handle))
        stats = ShardRunner(task, report=lambda line: print(line, file=sys.stderr, flush=True)).run()
        print(json.dumps(stats.to_dict()))
        return 0
    if not PipesEnvVarParamsLoader().is_dagster_pipes_process():
        parser.error("not launched by Dagster Pipes: pass --task FILE")
    with open_dagster_pipes() as pipes:
        task = ShardTask.from_dict(pipes.get_extra("task"))
        prefix = f"shard {task.shard.shard_index:03d}: "
        try:
            runner = ShardRunner(
                task,
                report=lambda line: pipes.log.info(prefix + line),
                report_progress=lambda figures: pipes.report_custom_message(
                    worker_message_payload(ProgressMessage(figures))
                ),
            )
            stats = runner.run()
        except Exception as exc:  # the step's failure message, e.g. a full disk under the checkpoint
            pipes.report_custom_message(worker_message_payload(FailureMessage(f"{type(exc).__name__}: {exc}")))
            raise
        pipes.report_custom_message(worker_message_payload(StatsMessage(stats)))
    return 0


def exit_now(code: int) -> None:
    """Leave without tearing down torch and an in-process vLLM engine (~3 s a shard): by now every result is
    fsynced and the stats are reported. An engine in its own processes (VLLM_ENABLE_V1_MULTIPROCESSING=1)
    gets vLLM's orderly shutdown instead, so none of them outlives the worker."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        sys.exit(code)
    exit_without_teardown(code)


if __name__ == "__main__":
    exit_now(main())
