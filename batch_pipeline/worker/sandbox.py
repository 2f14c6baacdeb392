"""Running model-written Python where it can harm nothing: the code_evaluator tool's sandbox.

Each execution is a fresh `python -I` in a new session, with an empty working directory removed
afterwards, a scrubbed environment, its output captured in size-capped files, and resource limits (CPU
time, address space, file size, processes, open files). In every mode each pool slot runs as its own
unprivileged uid, switched to by util-linux `setpriv` (no namespace needed): the code cannot read or
write the job's files, the model cache or the worker's /proc, every process of that uid is killed when
the execution ends, and what it left in the shared temporary directories is removed. Where no uid switch
is possible (the worker is not root, or lacks CAP_SETUID/CAP_SETGID) the sandbox refuses to run code at
all (`SandboxUnavailable`). Memory is limited for all of an execution's processes together: by a cgroup
where one can be made, else by summing their resident memory while it runs. Where the kernel allows it,
`unshare` adds a network namespace with no interfaces up (no network), a PID namespace with its own
/proc (no other process visible; the namespace dies with its first process) and an IPC namespace.
Where the kernel refuses the network namespace (a container without CAP_SYS_ADMIN), the sandbox refuses to
run code as well (`SandboxUnavailable`), unless the operator has opted into code with the worker's network
(`SandboxSettings.allow_network`, BATCH_PIPELINE_SANDBOX_ALLOW_NETWORK). `Sandbox.isolation` says which of
these are in force; the job's metadata records it.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import queue
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import IO

# Executions run as uids from a base on (by default these), unused by any account: one uid per running
# execution on this machine, whichever worker runs it (see UidLeases), so that one execution's processes can
# neither signal nor exhaust the process limit of another, and cleaning up after one never touches another.
# This module takes its settings as values (SandboxSettings, read by the worker's entry point) and imports
# nothing of ours: it also runs alone under the system's Python, without pydantic (tests/worker/test_sandbox.py).
SANDBOX_UID_BASE = 61000
SANDBOX_UIDS = 64
SANDBOX_MEMORY_MB = 1024
_NAMESPACES = ["unshare", "--net", "--ipc", "--pid", "--mount-proc", "--fork", "--kill-child=SIGKILL"]
_ENVIRONMENT = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
NO_NETWORK_NAMESPACE = (
    "tool_config: the code_evaluator sandbox refuses to run model-written code here: the kernel gives it no "
    "network namespace (`unshare --net` is refused, as in a container without CAP_SYS_ADMIN), so the code "
    "would reach whatever the worker reaches, loopback services (the Dagster UI) and a cloud's metadata "
    "address included. Run tool_config shards where unshare is allowed; or, where the worker's own network is "
    "confined (a NetworkPolicy), the operator may set BATCH_PIPELINE_SANDBOX_ALLOW_NETWORK=1; or submit the "
    "job without tool_config."
)
# All a root worker needs to run the sandbox (the pod specs of tool_config shards keep these, drop the rest).
REQUIRED_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "SETUID", "SETGID")
# Where any uid may create files; what a slot's uid leaves there is removed after each execution.
SHARED_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run/lock")
WATCH_INTERVAL_S = 0.1  # how often a running execution's memory is checked


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot hold here, so it runs no code; the message says why and what would fix it."""


@dataclass(frozen=True)
class SandboxSettings:
    """The operator's choices (BATCH_PIPELINE_SANDBOX_*, documented in core/settings.py), as the worker's
    entry point read them."""

    uid_base: int = SANDBOX_UID_BASE
    uids: int = SANDBOX_UIDS
    memory_mb: int = SANDBOX_MEMORY_MB
    python: str = ""  # unset: the worker's own, else the system's (sandbox_python)
    # Run code even where no network namespace can be made: it then reaches whatever the worker reaches.
    allow_network: bool = False

    def limits(self, timeout_s: float) -> SandboxLimits:
        return SandboxLimits(timeout_s=timeout_s, memory_bytes=self.memory_mb * 2**20)


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 60.0
    memory_bytes: int = SANDBOX_MEMORY_MB * 2**20
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
    memory: str
    leftovers: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


class Sandbox:
    """A bounded pool of execution slots; `run` blocks for a free slot, so callers may submit freely.

    Raises SandboxUnavailable where no slot uid can be switched to: code never runs as the worker's user;
    and where no network namespace can be made, unless `settings.allow_network`."""

    def __init__(
        self, limits: SandboxLimits | None = None, slots: int | None = None, settings: SandboxSettings | None = None
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.slots = slots or max(1, min(8, os.cpu_count() or 1))
        self.settings = settings = settings or SandboxSettings()
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(self.slots):
            self._free.put(slot)
        self.python = sandbox_python(settings.python)
        self._stopping = threading.Event()
        self._uids = UidLeases(settings.uid_base, settings.uids)
        self._check_uid_switch()
        self._namespaces = self._probe_namespaces()
        if not self._namespaces and not settings.allow_network:
            raise SandboxUnavailable(NO_NETWORK_NAMESPACE)
        self._cgroups = self._probe_cgroups()
        mib = self.limits.memory_bytes // 2**20
        last_uid = settings.uid_base + settings.uids - 1
        self.isolation = Isolation(
            user=f"uids {settings.uid_base}-{last_uid}, one per running execution on "
            "this machine, with no groups, no capabilities and no new privileges (setpriv)",
            namespaces="network, PID, IPC, mount" if self._namespaces else "none (the kernel refused unshare)",
            network="no network (an empty network namespace)"
            if self._namespaces
            else "NOT isolated: the code can reach whatever the worker can (the operator allowed it: "
            "BATCH_PIPELINE_SANDBOX_ALLOW_NETWORK)",
            memory=f"{mib} MiB for all its processes together (cgroup v{self._cgroups.version}), "
            f"{self.limits.processes} processes"
            if self._cgroups
            else f"{mib} MiB for all its processes together, their resident memory summed every "
            f"{WATCH_INTERVAL_S:g} s (no cgroup could be made); {mib} MiB of address space each",
            leftovers=f"removed after each execution: the slot uid's files in {', '.join(SHARED_WRITABLE)} "
            "and its System V IPC objects; no POSIX message queue can be made",
        )

    def stop(self) -> None:
        """End every running execution now, as if its time were up (the shard is stopping); later ones too."""
        self._stopping.set()

    def run(self, code: str, timeout_s: float | None = None) -> Execution:
        slot = self._free.get()
        try:
            with self._uids.lease() as uid:
                return self._run_in_slot(code, slot, uid, timeout_s or self.limits.timeout_s)
        finally:
            self._free.put(slot)

    def _run_in_slot(self, code: str, slot: int, uid: int, timeout_s: float) -> Execution:
        private = tempfile.mkdtemp(prefix="batch-pipeline-exec-")  # 0700, the worker's: code and captures
        workdir = tempfile.mkdtemp(prefix="batch-pipeline-sandbox-")
        cgroup = ExecutionCgroup(self._cgroups, slot, self.limits) if self._cgroups else None
        started = time.monotonic()
        try:
            os.chown(workdir, uid, uid)
            program = os.path.join(private, "program.py")
            with open(program, "w", encoding="utf-8") as handle:
                handle.write(code)
            stdout_path, stderr_path = os.path.join(private, "stdout"), os.path.join(private, "stderr")
            status_read, status_write = os.pipe()
            with (
                open(program, "rb") as stdin,
                open(stdout_path, "wb") as stdout,
                open(stderr_path, "wb") as stderr,
                open(status_read, "rb", buffering=0) as status,
            ):
                entering = cgroup.entering() if cgroup else []
                try:
                    process = subprocess.Popen(
                        [
                            *entering,
                            *self._limits(timeout_s),
                            self.python,
                            "-I",
                            "-S",
                            "-c",
                            _REAPER,
                            str(status_write),
                            *_command(self.python, uid, self._namespaces),
                        ],
                        stdin=stdin,
                        stdout=stdout,
                        stderr=stderr,
                        cwd=workdir,
                        pass_fds=[status_write],
                        env={**_ENVIRONMENT, "HOME": workdir, "TMPDIR": workdir},
                        start_new_session=True,
                    )
                finally:
                    os.close(status_write)
                try:
                    returncode, timed_out, over_memory = self._supervise(status, uid, cgroup, started + timeout_s)
                finally:
                    self._kill_everything(process, uid)
                over_memory = over_memory or (cgroup is not None and cgroup.memory_exceeded())
            output = _read_bounded(stdout_path, self.limits.output_chars)
            error = None
            if over_memory:
                error = (
                    f"MemoryError: the code's processes together used more than "
                    f"{self.limits.memory_bytes // 2**20} MiB and were stopped"
                )
            elif timed_out:
                error = f"TimeoutError: the code ran longer than {timeout_s:g} s and was stopped"
            elif returncode != 0:
                # _supervise reports no status only together with timed_out or over_memory (handled above).
                assert returncode is not None
                error = _last_error_line(stderr_path, returncode)
            return Execution(
                output=output, error=error, timed_out=timed_out, wall_s=round(time.monotonic() - started, 3)
            )
        finally:
            _remove_leftovers(uid)
            if cgroup is not None:
                cgroup.remove()
            shutil.rmtree(workdir, ignore_errors=True)
            shutil.rmtree(private, ignore_errors=True)

    def _supervise(
        self, status: IO[bytes], uid: int, cgroup: ExecutionCgroup | None, deadline: float
    ) -> tuple[int | None, bool, bool]:
        """Wait for the program (its reaper reports its exit status): (that status, whether it ran out of
        time, whether its processes together went over the memory limit). Either of the last two stops
        the wait at once."""
        while True:
            if select.select([status], [], [], WATCH_INTERVAL_S)[0]:
                reported = status.read(32).strip()
                return (int(reported) if reported else -signal.SIGKILL), False, False
            if cgroup.memory_exceeded() if cgroup else resident_bytes(uid) > self.limits.memory_bytes:
                return None, False, True
            if time.monotonic() >= deadline or self._stopping.is_set():
                return None, True, False

    def _limits(self, timeout_s: float) -> list[str]:
        """util-linux prlimit: set in the process that then execs the sandbox, inherited by all it starts
        (rather than a preexec_fn, which is not safe in the worker's threaded process)."""
        limits, cpu = self.limits, math.ceil(timeout_s) + 1
        arguments = [
            f"--cpu={cpu}",
            f"--as={limits.memory_bytes}",
            f"--fsize={limits.file_bytes}",
            f"--nofile={limits.open_files}",
            f"--nproc={limits.processes}",
            "--core=0",
            "--msgqueue=0",
        ]  # POSIX message queues outlive processes, out of reach of the clean-up
        return ["prlimit", *arguments, "--"]

    def _kill_everything(self, process: subprocess.Popen, uid: int) -> None:
        """The whole tree, including processes that left the session or outlived the program."""
        # Until the uid has no process left, zombies included (they count against its process limit): a
        # fork bomb may fork while a kill runs, and killed processes take a moment to be reaped. The slot
        # is not reused before then.
        deadline = time.monotonic() + 10
        while processes_of(uid, zombies=True) and time.monotonic() < deadline:
            if processes_of(uid):
                subprocess.run(
                    [*_as_slot_user(uid), self.python, "-I", "-S", "-c", _KILL_ALL], check=False, env=_ENVIRONMENT
                )
            time.sleep(0.02)
        try:  # the reaper leaves once it has no child left; the root wrappers go with it
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def _check_uid_switch(self) -> None:
        """Fail closed: without a uid of its own the code would run as the worker, with its files and secrets."""
        with self._uids.lease() as uid:
            self._probe_uid_switch(uid)

    def _probe_uid_switch(self, uid: int) -> None:
        probe = [
            *_as_slot_user(uid),
            self.python,
            "-I",
            "-S",
            "-c",
            "import os; print(*os.getresuid(), *os.getresgid(), os.getgroups())",
        ]
        try:
            done = subprocess.run(probe, capture_output=True, text=True, timeout=30, env=_ENVIRONMENT)
            if done.returncode == 0 and done.stdout.split() == [str(uid)] * 6 + ["[]"]:
                return
            reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        except (OSError, subprocess.TimeoutExpired) as exc:
            reason = str(exc)
        raise SandboxUnavailable(
            f"tool_config: the code_evaluator sandbox refuses to run model-written code here: the worker "
            f"(uid {os.geteuid()}) cannot switch to an unprivileged uid for it ({reason}). Run tool_config "
            f"shards as root with at least the capabilities {', '.join(REQUIRED_CAPABILITIES)}, "
            "or submit the job without tool_config."
        )

    def _probe_namespaces(self) -> bool:
        with self._uids.lease() as uid:
            try:
                return (
                    subprocess.run(_command("true", uid, namespaces=True), capture_output=True, timeout=10).returncode
                    == 0
                )
            except (OSError, subprocess.TimeoutExpired):
                return False

    def _probe_cgroups(self) -> CgroupParents | None:
        return CgroupParents.find()


def sandbox_python(configured: str = "") -> str:
    """An interpreter an unprivileged uid may run: `configured` if set, else the worker's own when every
    directory above it is open to others (a venv under /root is not), else the system's."""
    for candidate in filter(None, [configured, sys.executable, "/usr/local/bin/python3", "/usr/bin/python3"]):
        if _open_to_others(os.path.realpath(candidate)):
            return candidate
    raise SandboxUnavailable(
        "tool_config: the code_evaluator sandbox has no Python interpreter that an "
        "unprivileged user may run; set BATCH_PIPELINE_SANDBOX_PYTHON"
    )


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


def _as_slot_user(uid: int) -> list[str]:
    # setpriv switches uid itself, so the switch never depends on unshare being allowed. No groups, no
    # inheritable (so no ambient) capabilities; no_new_privs: no setuid binary or file capability gives
    # any privilege back, which also makes the bounding set moot (dropping it would need CAP_SETPCAP).
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--no-new-privs"]


def _command(python: str, uid: int, namespaces: bool) -> list[str]:
    # -I: no PYTHON* variables, no user site, no working directory on sys.path; the program comes on stdin.
    program = [*_as_slot_user(uid), *([python] if python == "true" else [python, "-I", "-"])]
    return [*_NAMESPACES, *program] if namespaces else program


# Root, before the uid switch: a child subreaper, so every process the code orphans becomes its child and
# is reaped here, not left a zombie of the pod's init (often the worker itself, which reaps nothing). It
# reports the program's exit status on the given descriptor, then stays until it has no child left.
_REAPER = """
import ctypes, os, sys
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
    sys.exit("the sandbox cannot reap what the code leaves: prctl(PR_SET_CHILD_SUBREAPER) failed")
status = int(sys.argv[1])
program = os.fork()
if program == 0:
    os.close(status)
    os.execvp(sys.argv[2], sys.argv[2:])
while True:
    try:
        pid, code = os.wait()
    except ChildProcessError:
        break
    if pid == program:
        os.write(status, b"%d\\n" % os.waitstatus_to_exitcode(code))
        os.close(status)
"""
_KILL_ALL = "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept ProcessLookupError:\n    pass\n"


def _process_statuses() -> Iterator[tuple[int, dict[str, str]]]:
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/status") as handle:
                yield int(entry), dict(line.split(":", 1) for line in handle if ":" in line)
        except OSError:
            continue


def processes_of(uid: int, zombies: bool = False) -> list[int]:
    """Live processes of a uid; zombies (dead, waiting for their parent to reap them) only if asked."""
    return [
        pid
        for pid, status in _process_statuses()
        if int(status["Uid"].split()[0]) == uid and (zombies or not status["State"].strip().startswith("Z"))
    ]


def resident_bytes(uid: int) -> int:
    """Memory a uid's processes hold: their private and shared-memory pages (world-readable in /proc, so
    no CAP_SYS_PTRACE). Pages still shared after a fork count once per process: it errs on the safe side."""
    total = 0
    for _, status in _process_statuses():
        if int(status["Uid"].split()[0]) == uid:
            total += sum(int(status.get(field, "0 kB").split()[0]) for field in ("RssAnon", "RssShmem")) * 1024
    return total


@dataclass(frozen=True)
class CgroupParents:
    """Where this worker may make a cgroup per execution: its own cgroup, in the unified (v2) hierarchy
    or in the v1 `memory` (and `pids`) hierarchies."""

    version: int
    memory: str
    pids: str | None

    @classmethod
    def find(cls) -> CgroupParents | None:
        own: dict[str, str] = {}  # controller ("" for v2) -> this process's cgroup in its hierarchy
        with open("/proc/self/cgroup") as handle:
            for line in handle:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for controller in controllers.split(",") if controllers else [""]:
                    own[controller] = path
        mounts: dict[str, str] = {}  # controller ("" for v2) -> the directory of this process's cgroup
        with open("/proc/self/mountinfo") as handle:
            for line in handle:
                fields, _, rest = line.partition(" - ")
                root, mount_point = fields.split()[3:5]
                fstype, _, options = rest.split()[:3]
                if fstype == "cgroup2":
                    names = [""]
                elif fstype == "cgroup":
                    names = [name for name in ("memory", "pids") if name in options.split(",")]
                else:
                    continue
                for name in names:
                    own_path = own.get(name)
                    if own_path is not None and (own_path + "/").startswith(root.rstrip("/") + "/"):
                        mounts.setdefault(name, mount_point + own_path[len(root.rstrip("/")) :])
        candidates = []
        if "" in mounts:
            candidates.append(cls(2, mounts[""], mounts[""]))
        if "memory" in mounts:
            candidates.append(cls(1, mounts["memory"], mounts.get("pids")))
        for candidate in candidates:
            with contextlib.suppress(OSError):
                candidate._enable_controllers()
                ExecutionCgroup(candidate, 0, SandboxLimits()).remove()
                return candidate
        return None

    def _enable_controllers(self) -> None:
        if self.version == 2:
            with open(os.path.join(self.memory, "cgroup.controllers")) as handle:
                if not {"memory", "pids"} <= set(handle.read().split()):
                    raise OSError("the memory and pids controllers are not available")
            # Refused (EBUSY) where the worker's own cgroup holds processes and is not a namespace's root.
            with open(os.path.join(self.memory, "cgroup.subtree_control"), "w") as handle:
                handle.write("+memory +pids")


class UidLeases:
    """The sandbox uids of this machine, leased one per running execution across every worker process: a
    lease is an exclusive lock on the uid's file in a directory of the worker's user, so that killing every
    process of a uid and removing its files after an execution never reach another worker's execution."""

    def __init__(self, base: int = SANDBOX_UID_BASE, count: int = SANDBOX_UIDS) -> None:
        self.uids = range(base, base + count)
        self.directory = os.path.join(tempfile.gettempdir(), f"batch-pipeline-uid-leases-{os.geteuid()}")
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        found = os.lstat(self.directory)
        # Made by this user, for it alone: not a directory a sandboxed uid planted in the shared /tmp.
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.geteuid() or found.st_mode & 0o077:
            raise SandboxUnavailable(
                f"tool_config: the sandbox's lock directory {self.directory} is not the worker's own (owner uid "
                f"{found.st_uid}, mode {stat.S_IMODE(found.st_mode):o}); remove it"
            )

    @contextlib.contextmanager
    def lease(self) -> Iterator[int]:
        """A uid no other execution of this machine runs as, until the block ends (waits while all are taken)."""
        while True:
            for uid in self.uids:
                descriptor = os.open(os.path.join(self.directory, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
                try:
                    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(descriptor)
                    continue
                try:
                    yield uid
                    return
                finally:
                    os.close(descriptor)  # releases the lock
            time.sleep(WATCH_INTERVAL_S)


class ExecutionCgroup:
    """One execution's cgroup(s), made with the limits for all its processes together, removed after."""

    def __init__(self, parents: CgroupParents, slot: int, limits: SandboxLimits) -> None:
        name = f"batch-pipeline-sandbox-{os.getpid()}-{slot}-{time.monotonic_ns()}"
        self.version = parents.version
        self.directories = [os.path.join(parents.memory, name)]
        if parents.pids and parents.pids != parents.memory:
            self.directories.append(os.path.join(parents.pids, name))
        for directory in self.directories:
            os.mkdir(directory, 0o755)
        try:
            memory, pids = self.directories[0], self.directories[-1]
            processes = limits.processes + 2  # and the root wrappers: unshare and its child until setpriv
            if self.version == 2:
                _write(memory, "memory.max", limits.memory_bytes)
                _write(memory, "memory.swap.max", 0, optional=True)
                _write(pids, "pids.max", processes)
            else:
                _write(memory, "memory.limit_in_bytes", limits.memory_bytes)
                _write(memory, "memory.memsw.limit_in_bytes", limits.memory_bytes, optional=True)  # no swap
                if len(self.directories) > 1:
                    _write(pids, "pids.max", processes)
        except OSError:
            self.remove()
            raise

    def entering(self) -> list[str]:
        """A command prefix: the process joins the cgroup(s), then execs the rest (so every process it
        starts is inside, with no window before)."""
        script = 'while [ "$1" != -- ]; do echo $$ > "$1/cgroup.procs" || exit 125; shift; done; shift; exec "$@"'
        return ["/bin/sh", "-c", script, "sh", *self.directories, "--"]

    def memory_exceeded(self) -> bool:
        """Whether the kernel killed any of its processes for going over the limit."""
        events = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(self.directories[0], events)) as handle:
                counts = dict(line.split() for line in handle if len(line.split()) == 2)
        except OSError:
            return False
        return int(counts.get("oom_kill", 0)) > 0

    def remove(self) -> None:
        for directory in self.directories:
            for _ in range(250):  # a killed process leaves its cgroup a moment after it dies
                try:
                    os.rmdir(directory)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def _write(directory: str, name: str, value: int, optional: bool = False) -> None:
    try:
        with open(os.path.join(directory, name), "w") as handle:
            handle.write(str(value))
    except OSError:
        if not optional:
            raise


def _remove_leftovers(uid: int) -> None:
    """What the uid left where others could see it: files in the shared temporary directories and its
    System V IPC objects. Runs once its processes are gone, so nothing races the removal."""
    for top in SHARED_WRITABLE:
        if os.path.isdir(top) and not os.path.islink(top):
            _remove_files_of(uid, top)
    objects = []
    for kind, flag in (("shm", "-m"), ("msg", "-q"), ("sem", "-s")):
        with contextlib.suppress(OSError), open(f"/proc/sysvipc/{kind}") as handle:
            header, *rows = [line.split() for line in handle]
            for row in rows:
                record = dict(zip(header, row))
                if str(uid) in (record.get("uid"), record.get("cuid")):
                    objects += [flag, row[1]]  # the id column
    if objects:  # removed as their creator: root would need CAP_SYS_ADMIN
        subprocess.run([*_as_slot_user(uid), "ipcrm", *objects], capture_output=True, check=False, env=_ENVIRONMENT)


def _remove_files_of(uid: int, top: str) -> None:
    # The uid can only have made entries in directories others may write: the walk follows those (and
    # what the uid made, removed whole) and no others, so its cost does not grow with what else lies in
    # /tmp. A world-writable directory below one others may not write is not reached (said in docs/tool-use.md).
    for directory, subdirectories, files in os.walk(top, onerror=lambda _: None):
        try:
            writable = os.stat(directory).st_mode & stat.S_IWOTH
        except OSError:
            subdirectories.clear()
            continue
        entered = []
        for name in subdirectories:
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                status = os.lstat(path)
                if status.st_uid == uid and stat.S_ISDIR(status.st_mode):
                    shutil.rmtree(path, ignore_errors=True)
                elif status.st_uid == uid:  # a symbolic link to a directory: the link goes, not its target
                    os.unlink(path)
                elif stat.S_ISDIR(status.st_mode) and status.st_mode & stat.S_IWOTH and status.st_mode & stat.S_IXOTH:
                    entered.append(name)
        subdirectories[:] = entered
        if writable:
            for name in files:
                path = os.path.join(directory, name)
                with contextlib.suppress(OSError):
                    if os.lstat(path).st_uid == uid:
                        os.unlink(path)


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
