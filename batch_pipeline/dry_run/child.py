"""The dry run's checking process: the reading, rendering and tokenizing of `dry_run.counting` in a child of
its own, bounded in memory and time, with one typed answer back. A chat template is the request's own
program (Jinja), free to loop for hours or build strings of gigabytes, and the API process serves every
tenant."""

from __future__ import annotations

import multiprocessing
import os
import resource
from dataclasses import dataclass
from multiprocessing.connection import Connection

from batch_pipeline.admission.paths import DataFiles
from batch_pipeline.admission.submission import UnservableRequest
from batch_pipeline.contract import CreateBatchCompletionsV2Request
from batch_pipeline.core.settings import settings
from batch_pipeline.dry_run.counting import Counts, count, model_of, records, short, source_field

# What the checking child needs, imported once by the forkserver it forks from rather than by each child.
_CHILD_PRELOAD = [
    "batch_pipeline.dry_run.child",
    "batch_pipeline.worker.openai_requests",
    "batch_pipeline.worker.v1_requests",
]


@dataclass(frozen=True)
class Counted:
    counts: Counts
    context_length: int


@dataclass(frozen=True)
class Unservable:
    """What makes the whole job fail, by field (`UnservableRequest.refused`)."""

    refused: list[tuple[str, str]]


@dataclass(frozen=True)
class Failed:
    message: str


Outcome = Counted | Unservable | Failed


def counted_apart(request: CreateBatchCompletionsV2Request, files: DataFiles) -> tuple[Counts, int]:
    """The request's counts and the model's context, from a child process that may add at most
    BATCH_PIPELINE_DRY_RUN_MEMORY_MB to what it starts with and is stopped after
    BATCH_PIPELINE_DRY_RUN_TIMEOUT_S."""
    configured = settings()
    source = source_field(request)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_CHILD_PRELOAD)  # no effect once this process's forkserver runs
    receiving, sending = context.Pipe(duplex=False)
    memory_bytes = configured.dry_run_memory_mb * 2**20
    child = context.Process(
        target=_count_in_child,
        args=(request, files, sending, memory_bytes, configured.dry_run_timeout_s, dict(os.environ), os.getcwd()),
        daemon=True,
    )
    child.start()
    sending.close()  # the child's end: an EOF here then means the child is gone
    try:
        if not receiving.poll(configured.dry_run_timeout_s):
            raise UnservableRequest(
                [
                    (
                        source,
                        f"the dry run was stopped after {configured.dry_run_timeout_s:g} s (a chat template that "
                        "does not end?); the job's shards would spend their time on the same requests",
                    )
                ]
            )
        try:
            outcome = receiving.recv()
        except EOFError:
            raise UnservableRequest(
                [
                    (
                        source,
                        f"the dry run's checking process ended without an answer (exit code {child.exitcode}); "
                        f"it may hold at most {configured.dry_run_memory_mb} MiB",
                    )
                ]
            ) from None
    finally:
        child.kill()
        child.join()
        receiving.close()
    match outcome:
        case Counted(counts, context_length):
            return counts, context_length
        case Unservable(refused):
            raise UnservableRequest(refused)
        case Failed(message):
            raise RuntimeError(f"the dry run failed: {message}")
    raise RuntimeError(f"the dry run's child answered {type(outcome).__name__}")


def _count_in_child(
    request: CreateBatchCompletionsV2Request,
    files: DataFiles,
    answer: Connection,
    memory_bytes: int,
    timeout_s: float,
    environment: dict[str, str],
    cwd: str,
) -> None:
    """The child's side: limits first, then the dry run's reading, rendering and counting; one message back."""
    # Forked from the forkserver, it has that server's environment and directory: it reads the request's
    # paths and the settings as the API process would now.
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(cwd)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + memory_bytes,) * 2)
    cpu_s = int(timeout_s) + 5  # the parent stops it first; this holds should the parent be gone
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    source = source_field(request)
    outcome: Outcome
    try:
        model = model_of(request.model_cfg)
        outcome = Counted(count(request, model, records(request, files), source), model.context_length)
    except UnservableRequest as exc:
        outcome = Unservable(exc.refused)
    except MemoryError:
        outcome = Unservable([(source, f"checking the requests took more than {memory_bytes // 2**20} MiB")])
    except Exception as exc:
        outcome = Failed(f"{type(exc).__name__}: {short(exc)}")
    answer.send(outcome)
    answer.close()


def _address_space() -> int:
    """This process's virtual memory now, in bytes: the child's limit counts from what it starts with."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")
