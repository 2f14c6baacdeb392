"""The dry run's checking process: the reading, rendering and tokenizing of `dry_run.counting` in a child of
its own, bounded in memory and time, with one typed answer back. A chat template is the request's own
program (Jinja), free to loop for hours or build strings of gigabytes, and the API process serves every
tenant.

Each child is forked from a server process (`ChildServer`) that has imported what the children need once
(vLLM's modules, ~10 s), as multiprocessing's forkserver would; unlike that one, the server is started with
an environment built from the allow-list (core/environment.py), not the API process's: the children fork
its memory, and the API's environment holds the API keys and, in a local deployment, every team's webhook
secrets."""

from __future__ import annotations

import contextlib
import importlib
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

from batch_pipeline.admission.paths import DataFiles
from batch_pipeline.admission.submission import UnservableRequest
from batch_pipeline.contract import CreateBatchCompletionsV2Request
from batch_pipeline.core.environment import child_environment
from batch_pipeline.core.settings import settings
from batch_pipeline.dry_run.counting import Counts, count, model_of, records, short, source_field

# What the checking child needs, imported once by the server it forks from rather than by each child.
_CHILD_PRELOAD = [
    "batch_pipeline.worker.openai_requests",
    "batch_pipeline.worker.v1_requests",
]


@dataclass(frozen=True)
class Counted:
    counts: Counts
    context_length: int


@dataclass(frozen=True)
class ModelRead:
    """The model alone was read (a submission's check): its context."""

    context_length: int


@dataclass(frozen=True)
class Unservable:
    """What makes the whole job fail, by field (`UnservableRequest.refused`)."""

    refused: list[tuple[str, str]]


@dataclass(frozen=True)
class Failed:
    message: str


Outcome = Counted | ModelRead | Unservable | Failed


def counted_apart(request: CreateBatchCompletionsV2Request, files: DataFiles) -> tuple[Counts, int]:
    """The request's counts and the model's context, from a child process that may add at most
    BATCH_PIPELINE_DRY_RUN_MEMORY_MB to what it starts with and is stopped after
    BATCH_PIPELINE_DRY_RUN_TIMEOUT_S."""
    outcome = _answer_apart(
        request,
        files,
        source_field(request),
        "(a chat template that does not end?); the job's shards would spend their time on the same requests",
    )
    if not isinstance(outcome, Counted):
        raise RuntimeError(f"the dry run's child answered {type(outcome).__name__}")
    return outcome.counts, outcome.context_length


def model_context_apart(request: CreateBatchCompletionsV2Request) -> int:
    """The context of the request's model as its job's engine would read it (the dry run's `model_of`, no
    record read), from a child bounded as a dry run's is. Raises UnservableRequest naming the model's field
    where the engine could not read it: a name neither on the hub nor on disk, a hub this server cannot
    reach, a max_model_len past the model's."""
    outcome = _answer_apart(
        request,
        None,
        "model_config.model",
        "reading the model (a hub that does not answer?); its job's engine would wait too",
    )
    if not isinstance(outcome, ModelRead):
        raise RuntimeError(f"the dry run's child answered {type(outcome).__name__}")
    return outcome.context_length


def _answer_apart(
    request: CreateBatchCompletionsV2Request, files: DataFiles | None, field: str, stopped: str
) -> Counted | ModelRead:
    """A child's answer: the request counted (`files`), or its model read alone (None). `field` is named
    where the child was stopped (`stopped` says what it was doing) or died."""
    configured = settings()
    memory_bytes = configured.dry_run_memory_mb * 2**20
    # The request's paths may be on an object store, read as the API process would read them.
    environment = child_environment(os.environ, object_store=True)
    receiving, child_pid = ChildServer.running(environment).fork()
    try:
        receiving.send((request, files, memory_bytes, configured.dry_run_timeout_s, environment, os.getcwd()))
        if not receiving.poll(configured.dry_run_timeout_s):
            raise UnservableRequest(
                [
                    (
                        field,
                        f"the dry run was stopped after {configured.dry_run_timeout_s:g} s {stopped}",
                    )
                ]
            )
        try:
            outcome = receiving.recv()
        except EOFError:
            raise UnservableRequest(
                [
                    (
                        field,
                        "the dry run's checking process ended without an answer; "
                        f"it may hold at most {configured.dry_run_memory_mb} MiB",
                    )
                ]
            ) from None
    finally:
        with contextlib.suppress(ProcessLookupError):  # it answered and left, or died
            os.kill(child_pid, signal.SIGKILL)
        receiving.close()
    match outcome:
        case Counted() | ModelRead():
            return outcome
        case Unservable(refused):
            raise UnservableRequest(refused)
        case Failed(message):
            raise RuntimeError(f"the dry run failed: {message}")
    raise RuntimeError(f"the dry run's child answered {type(outcome).__name__}")


class ChildServer:
    """The process the checking children are forked from: `python -m batch_pipeline.dry_run.child`, in the
    allow-listed environment, sent one end of a new socket pair per child over its control socket."""

    _running: ChildServer | None = None
    _lock = threading.Lock()

    def __init__(self, environment: dict[str, str]) -> None:
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "batch_pipeline.dry_run.child", str(theirs.fileno())],
                env=environment,
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        self._sending = threading.Lock()

    @classmethod
    def running(cls, environment: dict[str, str]) -> ChildServer:
        """This process's server, started (again, should it have died) in `environment`."""
        with cls._lock:
            if cls._running is None or cls._running.process.poll() is not None:
                cls._running = cls(environment)
            return cls._running

    def fork(self) -> tuple[Connection, int]:
        """A new checking child: the connection to it, and its pid."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with theirs, self._sending:
            socket.send_fds(self.control, [b"fork"], [theirs.fileno()])
        connection = Connection(ours.detach())
        try:
            pid = connection.recv()
        except EOFError:
            connection.close()
            raise RuntimeError(
                f"the dry run's server could not start a child (exit code {self.process.poll()})"
            ) from None
        return connection, pid


def _serve(control_fd: int) -> None:
    """The server's side: import once, then fork a child for each socket sent, until the API process is gone."""
    for module in _CHILD_PRELOAD:
        importlib.import_module(module)
    control = socket.socket(fileno=control_fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    while True:
        message, fds, _, _ = socket.recv_fds(control, 16, 1)
        if not message:  # the API process closed its end: it is gone
            return
        if os.fork() == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            control.close()
            connection = Connection(fds[0])
            try:
                connection.send(os.getpid())
                _count_in_child(connection, *connection.recv())
            finally:
                os._exit(0)
        os.close(fds[0])


def _count_in_child(
    answer: Connection,
    request: CreateBatchCompletionsV2Request,
    files: DataFiles | None,
    memory_bytes: int,
    timeout_s: float,
    environment: dict[str, str],
    cwd: str,
) -> None:
    """The child's side: limits first, then the dry run's reading, rendering and counting (or, without
    `files`, the model's reading alone); one message back."""
    # Forked from the server, it has the environment and directory the server started with: it reads the
    # request's paths and the settings as the API process would now (the allow-listed part of them).
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
        if files is None:
            outcome = ModelRead(model.context_length)
        else:
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


if __name__ == "__main__":
    # The module's own copy, not __main__'s: what the children send back unpickles as its classes.
    from batch_pipeline.dry_run.child import _serve as serve

    serve(int(sys.argv[1]))
