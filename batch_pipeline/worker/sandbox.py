"""Running model-written Python where it can harm nothing: the code_evaluator tool's sandbox.

Each execution is a fresh `python -I` in a new session, with an empty working directory removed
afterwards, a scrubbed environment, its output captured in size-capped files, and resource limits (CPU
time, address space, file size, processes, open files). Where the worker runs as root, each pool slot
runs as its own unprivileged uid: the code cannot read or write the job's files, the model cache or the
worker's /proc, and every process of that uid is killed when the execution ends. Where the kernel
allows it, `unshare` adds a network namespace with no interfaces up (no network), a PID namespace with
its own /proc (no other process visible; the namespace dies with its first process) and an IPC
namespace. `Sandbox.isolation` says which of these are in force; the job's metadata records it.
"""

from __future__ import annotations

import math
import os
import queue
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

# Slots run as uids SANDBOX_UID_BASE + slot: unused by any account, one per slot so that one execution's
# processes can neither signal nor exhaust the process limit of another.
SANDBOX_UID_BASE = int(os.environ.get("BATCH_PIPELINE_SANDBOX_UID_BASE", "61000"))
_NAMESPACES = ["unshare", "--net", "--ipc", "--pid", "--mount-proc", "--fork", "--kill-child=SIGKILL"]
_ENVIRONMENT = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 60.0
    memory_bytes: int = int(os.environ.get("BATCH_PIPELINE_SANDBOX_MEMORY_MB", "1024")) * 2**20
    file_bytes: int = 16 * 2**20  # any file it writes, its captured output included
    processes: int = 32
    open_files: int = 64
    output_chars: int = 8192  # what is fed back to the model


@dataclass(frozen=True)
class Execution:
    """What one execution printed, and why it failed when it did (`error` is None on success)."""

    output: str
    error: str | None = None
    timed_out: bool = False
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    def feedback(self) -> str:
        """The text the model reads after `>>>`: the output, then the error's last line when it failed."""
        parts = [self.output] if self.output else []
        if self.error:
            parts.append(self.error)
        text = "\n".join(part.rstrip("\n") for part in parts)
        return text + "\n" if text else ""


@dataclass
class Isolation:
    user: str
    namespaces: str
    network: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


class Sandbox:
    """A bounded pool of execution slots; `run` blocks for a free slot, so callers may submit freely."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), slots: int | None = None) -> None:
        self.limits = limits
        self.slots = slots or max(1, min(8, os.cpu_count() or 1))
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(self.slots):
            self._free.put(slot)
        self._as_root = os.geteuid() == 0
        self.python = sandbox_python() if self._as_root else sys.executable
        self._namespaces = self._probe_namespaces()
        self.isolation = Isolation(
            user=f"uids {SANDBOX_UID_BASE}-{SANDBOX_UID_BASE + self.slots - 1}, one per slot"
            if self._as_root else "the worker's uid (the worker does not run as root)",
            namespaces="network, PID, IPC, mount" if self._namespaces else "none (the kernel refused unshare)",
            network="no network (an empty network namespace)" if self._namespaces
            else "NOT isolated: the code can reach whatever the worker can",
        )

    def run(self, code: str, timeout_s: float | None = None) -> Execution:
        slot = self._free.get()
        try:
            return self._run_in_slot(code, slot, timeout_s or self.limits.timeout_s)
        finally:
            self._free.put(slot)

    def _run_in_slot(self, code: str, slot: int, timeout_s: float) -> Execution:
        uid = SANDBOX_UID_BASE + slot if self._as_root else None
        private = tempfile.mkdtemp(prefix="batch-pipeline-exec-")  # 0700, the worker's: code and captures
        workdir = tempfile.mkdtemp(prefix="batch-pipeline-sandbox-")
        started = time.monotonic()
        try:
            if uid is not None:
                os.chown(workdir, uid, uid)
            program = os.path.join(private, "program.py")
            with open(program, "w", encoding="utf-8") as handle:
                handle.write(code)
            stdout_path, stderr_path = os.path.join(private, "stdout"), os.path.join(private, "stderr")
            with open(program, "rb") as stdin, open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
                process = subprocess.Popen(
                    [*self._limits(timeout_s), *_command(self.python, uid, self._namespaces)],
                    stdin=stdin, stdout=stdout, stderr=stderr, cwd=workdir,
                    env={**_ENVIRONMENT, "HOME": workdir, "TMPDIR": workdir}, start_new_session=True,
                )
                timed_out = False
                try:
                    returncode = process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    returncode = None
                self._kill_everything(process, uid)
                if returncode is None:
                    returncode = process.wait()
            output = _read_bounded(stdout_path, self.limits.output_chars)
            error = None
            if timed_out:
                error = f"TimeoutError: the code ran longer than {timeout_s:g} s and was stopped"
            elif returncode != 0:
                error = _last_error_line(stderr_path, returncode)
            return Execution(output=output, error=error, timed_out=timed_out,
                             wall_s=round(time.monotonic() - started, 3))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            shutil.rmtree(private, ignore_errors=True)

    def _limits(self, timeout_s: float) -> list[str]:
        """util-linux prlimit: set in the process that then execs the sandbox, inherited by all it starts
        (rather than a preexec_fn, which is not safe in the worker's threaded process)."""
        limits, cpu = self.limits, math.ceil(timeout_s) + 1
        arguments = [f"--cpu={cpu}", f"--as={limits.memory_bytes}", f"--fsize={limits.file_bytes}",
                     f"--nofile={limits.open_files}", "--core=0"]
        if self._as_root or self._namespaces:  # counted per uid (or user namespace): the sandbox's own
            arguments.append(f"--nproc={limits.processes}")
        return ["prlimit", *arguments, "--"]

    def _kill_everything(self, process: subprocess.Popen, uid: int | None) -> None:
        """The whole tree, including processes that left the session or outlived the program."""
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if uid is None:
            return
        # Until the uid has no process left: a fork bomb may fork while a kill runs, and killed processes
        # take a moment to exit. The slot is not reused before then.
        deadline = time.monotonic() + 10
        while processes_of(uid) and time.monotonic() < deadline:
            subprocess.run([self.python, "-I", "-S", "-c", _KILL_ALL], user=uid, group=uid, extra_groups=[],
                           check=False, env=_ENVIRONMENT)
            time.sleep(0.02)

    def _probe_namespaces(self) -> bool:
        probe = _command("true", SANDBOX_UID_BASE if self._as_root else None, namespaces=True)
        try:
            return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False


def sandbox_python() -> str:
    """An interpreter an unprivileged uid may run: the worker's own when every directory above it is
    open to others (a venv under /root is not), else the system's."""
    configured = os.environ.get("BATCH_PIPELINE_SANDBOX_PYTHON")
    for candidate in filter(None, [configured, sys.executable, "/usr/local/bin/python3", "/usr/bin/python3"]):
        if _open_to_others(os.path.realpath(candidate)):
            return candidate
    raise RuntimeError("no Python interpreter that an unprivileged user may run; set BATCH_PIPELINE_SANDBOX_PYTHON")


def _open_to_others(path: str) -> bool:
    try:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(path)
        while parent != os.path.dirname(parent):
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            parent = os.path.dirname(parent)
    except OSError:
        return False
    return True


def _command(python: str, uid: int | None, namespaces: bool) -> list[str]:
    # -I: no PYTHON* variables, no user site, no working directory on sys.path; the program comes on stdin.
    program = [python] if python == "true" else [python, "-I", "-"]
    if not namespaces:
        return program
    if uid is None:  # an unprivileged worker: a user namespace makes the others possible
        return [_NAMESPACES[0], "--map-root-user", *_NAMESPACES[1:], *program]
    return [*_NAMESPACES, f"--setgid={uid}", f"--setuid={uid}", *program]


_KILL_ALL = "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept ProcessLookupError:\n    pass\n"


def processes_of(uid: int) -> list[int]:
    """Live processes of a uid; zombies (dead, waiting for their new parent to reap them) do not count."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/status") as handle:
                status = dict(line.split(":", 1) for line in handle if ":" in line)
        except OSError:
            continue
        if int(status["Uid"].split()[0]) == uid and not status["State"].strip().startswith("Z"):
            found.append(int(entry))
    return found


def _read_bounded(path: str, limit: int) -> str:
    with open(path, "rb") as handle:
        data = handle.read(limit * 4 + 4)  # UTF-8: at most 4 bytes a character
        more = handle.read(1) != b""
    text = data.decode("utf-8", errors="replace")
    if len(text) > limit or more:
        return text[:limit] + f"\n[output truncated to {limit} characters]"
    return text


def _last_error_line(stderr_path: str, returncode: int) -> str:
    """The exception line of a traceback, or how the process died."""
    with open(stderr_path, "rb") as handle:
        handle.seek(max(0, os.fstat(handle.fileno()).st_size - 4096))
        lines = [line for line in handle.read().decode("utf-8", errors="replace").splitlines() if line.strip()]
    if returncode < 0:
        name = signal.Signals(-returncode).name
        why = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (killed)", "SIGXFSZ": " (file size limit)"}.get(name, "")
        return f"the code was stopped by {name}{why}"
    return lines[-1] if lines else f"the code exited with status {returncode}"
