"""Chaos soak: the embedded deployment as separate processes, jobs of every kind, every component SIGKILLed
at random, then each job checked to have completed exactly once.

    .venv/bin/python bench/chaos_soak.py [--seed 1 2 3] [--jobs 24] [--faults 24] [--deadline-s 1800]
    .venv/bin/python bench/chaos_soak.py --scenario targeted --seed 1 2 3 --jobs 6 --faults 4

The deployment is `make serve`'s, each service a process of its own so that each can be killed alone: the
API (uvicorn, as serve runs it), the Dagster daemon, and a gRPC code server (which starts the run workers;
they start the shard workers, in the warm engine pool `serve` makes). Its instance config is the shipped
dagster.yaml (run monitoring, run retries, the queue's code-location retries), with the queue's delays
shortened (`--dequeue-interval-s`, `--code-server-retry-delay-s`) so a soak takes minutes.

Jobs (`JOB_KINDS`): v1, v2 completion (echo), v2 chat, v2 completion with deterministic repeats,
data_parallelism 2 (two shards), and chat sampled with a seed per request. Each is submitted by a client
that retries until it is answered, with an Idempotency-Key, and submits again with the same key once
answered (which must name the same job). At most `--in-flight` jobs are unfinished at once, so runs are
queued and running whenever a fault strikes.

Faults (`FAULT_KINDS`, a seeded random.Random picks them and the gaps between them; each kind at least
once): the API, the daemon, the code server (SIGKILL, restarted after a few seconds); the code server down
for a few seconds just as the queue dequeues a run; a run worker; a run worker orphaned by a code-server
restart, then killed (run monitoring must find it within `--detect-bound-s` and the daemon retry it); a
shard worker mid-shard (a worker of the engine pool: one started for its shard, or a warm one that served
shards before; the fault says which). Run and shard kills are limited to one of each per job: the runs carry
`dagster/max_retries: 2` and each shard step 2 retries, so a job killed more often than that may fail by
design.

The targeted scenario (`--scenario targeted`, `TARGETED_FAULT_KINDS`, issue 50) strikes one fault only, with
tight timing: the code server killed and started again at once, and 1 s after the kill the run worker it left
behind, while the new code server still loads its definitions. Run monitoring fails the run, and the run
retry daemon's retry usually meets the loading code server (gRPC UNAVAILABLE); each fault says whether it did.

Each job is then checked (`check_job`): one row in the job store for its key, the row `completed`, one
successful run among its runs, the API's GET says completed, the output exactly n entries, none an error,
in input order (each prompt carries a marker number m, and its prompt token count grows with m: entry i's
count must order as the markers do, equal for copies), copies equal to their source, the metadata file
present and naming the job and n, no `*.partial` or other stray file in the output dir or the job's work
dir, no two runs of the job live at once. Prints a table of jobs and one of faults; `--json PATH` writes the
result.

Cleanup touches only this process's own: it makes itself the child subreaper (orphaned run workers are
re-parented to it, not to init) and at the end kills its descendants and the process groups it started,
by pid, never by name.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
MODEL = "smollm2-135m-instruct"
BIN = Path(sys.executable).parent
JOB_KINDS = ("v1", "completion", "chat", "repeats", "dp2", "sampled")
FAULT_KINDS = (
    "api",
    "daemon",
    "code_server",
    "code_server_at_dequeue",
    "run_worker",
    "orphaned_run_worker",
    "shard_worker",
)
TARGETED_FAULT_KINDS = ("orphaned_run_worker_while_loading",)
SHARD_WATCH_S = 30.0  # how long the shard_worker fault watches for a shard worker on a shard
SCENARIOS = {"random": FAULT_KINDS, "targeted": TARGETED_FAULT_KINDS}
JOB_ID_TAG = "batch_pipeline/job_id"
PR_SET_CHILD_SUBREAPER = 36
# Set by SIGTERM (or SIGINT): the soak stops striking and submitting, checks what it submitted, and reports.
STOP = threading.Event()


# --- processes ------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first), or None where it has gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def children_table() -> dict[int, list[int]]:
    table: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            table.setdefault(int(fields[1]), []).append(int(entry))
    return table


def descendants(root: int) -> list[int]:
    table, found, stack = children_table(), [], [root]
    while stack:
        for child in table.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode("utf-8", "replace").split("\0")
    except OSError:
        return []


def _pipes_run_id(pid: int) -> str | None:
    """The Dagster run a shard worker serves, from the Pipes context in its environment."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"DAGSTER_PIPES_CONTEXT="):
            with contextlib.suppress(Exception):
                context = json.loads(zlib.decompress(base64.b64decode(item.split(b"=", 1)[1])))
                return context.get("data", context)["run_id"]
    return None


class Component:
    """One service of the deployment: its own process group, its output appended to its log."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log: Path, cwd: Path) -> None:
        self.name, self.command, self.env, self.log, self.cwd = name, command, env, log, cwd
        self.process: subprocess.Popen | None = None
        self.pgids: set[int] = set()
        self.starts = 0

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                self.command, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.pgids.add(self.process.pid)
        self.starts += 1

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self, group: bool) -> None:
        """SIGKILL the service (`group`: its whole process group, else the process alone, which leaves what it
        started running, orphaned) and reap it."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(self.process.pid, signal.SIGKILL)
            else:
                self.process.kill()
        self.process.wait()


def _reap_orphans(managed: set[int]) -> None:
    """Reap the exited processes re-parented to this one (it is their subreaper) that no Popen waits for."""
    for pid in children_table().get(os.getpid(), []):
        if pid not in managed and (fields := _stat(pid)) is not None and fields[0] == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


# --- jobs -----------------------------------------------------------------------------------------------


def prompt(marker: int) -> str:
    """A prompt whose token count grows with its marker: the output's order is checked by it."""
    return f"Item {marker}:" + " one" * (marker + 1) + " Go on."


@dataclass
class JobSpec:
    name: str
    kind: str
    markers: list[int]  # the marker of each request, in input order (repeats: copies share one)
    route: str
    body: dict[str, Any]
    key: str
    output: str


def job_spec(kind: str, name: str, out_dir: Path, rng: random.Random, prompts: int, max_tokens: int) -> JobSpec:
    """A job of `kind` with about `prompts` requests of at most `max_tokens` new tokens, its output in a
    directory of its own."""
    output = str(out_dir / name / "output.json")
    base: dict[str, Any] = {"output_data_path": output, "model_config": {"model": MODEL}, "labels": {"soak": name}}
    markers = list(range(prompts))
    route = "/v2/batch-completions"
    if kind in ("v1", "dp2"):
        if kind == "dp2":
            markers = list(range(prompts + 2))
        content = {"prompts": [prompt(m) for m in markers], "max_new_tokens": max_tokens, "temperature": 0.0}
        if kind == "v1":
            route = "/v1/llm/batch-completions"
        else:
            base["data_parallelism"] = 2
        base["content"] = content
    elif kind in ("completion", "repeats"):
        if kind == "repeats":  # deterministic copies, generated once and filled from their source
            markers = [rng.randrange(max(2, prompts // 2)) for _ in range(prompts + 2)]
            markers[:2] = [0, 0]
        base["content"] = [
            {"prompt": prompt(m), "max_tokens": max_tokens, "temperature": 0.0, "echo": True} for m in markers
        ]
    elif kind in ("chat", "sampled"):
        sampling: dict[str, Any] = {"temperature": 0.0}
        base["content"] = [
            {
                "messages": [{"role": "user", "content": prompt(m)}],
                "max_tokens": max_tokens,
                **(sampling if kind == "chat" else {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + m}),
            }
            for m in markers
        ]
    else:
        raise ValueError(kind)
    return JobSpec(name, kind, markers, route, base, f"soak-{name}-{uuid.uuid4().hex[:12]}", output)


# --- the soak -------------------------------------------------------------------------------------------


@dataclass
class SoakConfig:
    seed: int = 1
    scenario: str = "random"  # SCENARIOS: which faults strike
    jobs: int = 24
    faults: int = 24
    in_flight: int = 4
    prompts: int = 4
    max_tokens: int = 8
    gap_s: tuple[float, float] = (4.0, 12.0)
    deadline_s: float = 1800.0
    detect_bound_s: float = 60.0  # docs/guarantees.md: a dead run worker is found "well under a minute"
    max_concurrent_runs: int = 2
    dequeue_interval_s: int = 1
    code_server_retry_delay_s: int = 5
    monitoring_poll_s: int = 10  # as shipped
    work_dir: str | None = None  # default: a temporary directory, removed when the soak passes
    # The checkout whose batch_pipeline every process runs (PYTHONPATH), e.g. `git archive HEAD` unpacked:
    # a soak of half an hour then runs one version of the code, whatever is edited in this tree meanwhile.
    code_root: str | None = None
    keep: bool = False


@dataclass
class Fault:
    kind: str
    at_s: float
    target: str = ""
    detail: str = ""
    detect_s: float | None = None
    ok: bool = True


@dataclass
class JobResult:
    name: str
    kind: str
    n: int
    job_id: str = ""
    status: str = ""
    rows_for_key: int = 0
    runs: int = 0
    successful_runs: int = 0
    retries: int = 0
    submit_attempts: int = 0
    resumed: int = 0  # requests its successful run's shards found in their checkpoints
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class Soak:
    def __init__(self, config: SoakConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.root = Path(config.work_dir or tempfile.mkdtemp(prefix=f"chaos_soak_{config.seed}_"))
        self.home = self.root / "dagster_home"
        self.out_dir = self.root / "outputs"
        self.logs = self.root / "logs"
        for directory in (self.home, self.out_dir, self.logs):
            directory.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.deadline = self.started + config.deadline_s
        self.faults: list[Fault] = []
        self.events: list[str] = []
        self.specs: list[JobSpec] = []
        self.job_ids: dict[str, str] = {}  # spec name -> job id
        self.attempts: dict[str, int] = {}
        self.client_problems: dict[str, list[str]] = {}
        self.finished: set[str] = set()  # job ids
        self.hit_runs: set[str] = set()  # job ids whose run a fault killed
        self.hit_shards: set[str] = set()
        self.lock = threading.RLock()  # held while a fault has a service down, and for restarts
        self.stopping = False
        self.down: set[str] = set()
        self.api_port, self.grpc_port = _free_port(), _free_port()
        self.api = f"http://127.0.0.1:{self.api_port}"
        self.env = {
            **os.environ,
            "DAGSTER_HOME": str(self.home),
            "BATCH_PIPELINE_SENSOR_INTERVAL_S": "1",
            "BATCH_PIPELINE_MIN_SHARD_TOKENS": "0",  # a dp-2 job of a few prompts runs in two shards
            "BATCH_PIPELINE_RESULT_CACHE": "0",  # its checks count each job's generations
            "VLLM_LOGGING_LEVEL": "WARNING",
        }
        for variable in ("BATCH_PIPELINE_JOBS_DB", "BATCH_PIPELINE_WORK_DIR", "BATCH_PIPELINE_API_KEYS"):
            self.env.pop(variable, None)
        self.code_root = Path(config.code_root) if config.code_root else REPO
        if config.code_root:
            self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [config.code_root, os.environ.get("PYTHONPATH")]))
        self.components: dict[str, Component] = {}

    # -- the deployment --

    def log(self, message: str) -> None:
        line = f"[{time.monotonic() - self.started:7.1f}s] {message}"
        self.events.append(line)
        print(line, flush=True)

    def _write_config(self) -> None:
        shipped = yaml.safe_load((self.code_root / "dagster_home" / "dagster.yaml").read_text())
        shipped["run_coordinator"]["config"].update(
            max_concurrent_runs=self.config.max_concurrent_runs,
            dequeue_interval_seconds=self.config.dequeue_interval_s,
            user_code_failure_retry_delay=self.config.code_server_retry_delay_s,
        )
        shipped["run_monitoring"]["poll_interval_seconds"] = self.config.monitoring_poll_s
        (self.home / "dagster.yaml").write_text(yaml.safe_dump(shipped))
        self.workspace = self.root / "workspace.yaml"
        self.workspace.write_text(
            f"load_from:\n  - grpc_server:\n      host: 127.0.0.1\n      port: {self.grpc_port}\n"
            "      location_name: batch_pipeline\n"
        )

    def start(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self._write_config()
        os.environ.update({k: v for k, v in self.env.items() if k.startswith(("DAGSTER_", "BATCH_PIPELINE_"))})
        for variable in ("BATCH_PIPELINE_JOBS_DB", "BATCH_PIPELINE_WORK_DIR", "BATCH_PIPELINE_API_KEYS"):
            os.environ.pop(variable, None)
        from batch_pipeline.core.settings import settings
        from batch_pipeline.entrypoints.serve import _create_storage, api_command

        _create_storage(settings())
        from batch_pipeline.launch.pool import make_pool_directory

        # The warm engine pool, as `serve` makes one: its workers are this soak's descendants (killed at stop).
        self.env["BATCH_PIPELINE_ENGINE_POOL_DIR"] = self.pool = make_pool_directory()
        import dagster as dg

        from batch_pipeline.store.jobs import JobStore

        self.instance = dg.DagsterInstance.from_config(str(self.home))
        self.store = JobStore(f"sqlite:///{self.home}/batch_jobs.db")
        grpc = [str(BIN / "dagster"), "api", "grpc", "-m", "batch_pipeline.pipeline.definitions"]
        grpc += ["-h", "127.0.0.1", "-p", str(self.grpc_port)]
        commands = {
            "code_server": grpc,
            "daemon": [str(BIN / "dagster-daemon"), "run", "-w", str(self.workspace)],
            "api": api_command("127.0.0.1", self.api_port),
        }
        for name, command in commands.items():
            self.components[name] = Component(name, command, self.env, self.logs / f"{name}.log", self.code_root)
        for name in commands:
            self.restart(name)
        self.log(f"deployment up in {self.root} (API {self.api}, code server :{self.grpc_port})")

    def restart(self, name: str) -> None:
        component = self.components[name]
        component.start()
        if name == "code_server":
            self._wait(lambda: self._grpc_healthy(component), 180, "the code server did not come up")
        elif name == "api":
            self._wait(self._api_healthy, 120, "the API did not come up")
        self.down.discard(name)

    def _wait(self, predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise RuntimeError(what)
            time.sleep(0.3)

    def _grpc_healthy(self, component: Component) -> bool:
        if not component.running():
            raise RuntimeError(f"the code server exited: {component.log.read_text()[-3000:]}")
        check = [str(BIN / "dagster"), "api", "grpc-health-check", "-p", str(self.grpc_port)]
        return subprocess.run(check, capture_output=True, env=self.env).returncode == 0

    def _api_healthy(self) -> bool:
        try:
            return httpx.get(f"{self.api}/healthz", timeout=3).status_code == 200
        except httpx.TransportError:
            return False

    def _managed(self) -> set[int]:
        return {c.process.pid for c in self.components.values() if c.process is not None}

    def supervise(self) -> None:
        """A service that exits when no fault killed it is a finding: say so, and start it again."""
        _reap_orphans(self._managed())
        if not self.lock.acquire(blocking=False):  # a fault has a service down: the clients go on meanwhile
            return
        try:
            for name, component in self.components.items():
                if name not in self.down and not component.running():
                    code = component.process.returncode if component.process is not None else None
                    self.log(f"UNEXPECTED: {name} exited by itself (code {code}); restarting")
                    self.client_problems.setdefault("deployment", []).append(f"{name} exited by itself")
                    self.restart(name)
        finally:
            self.lock.release()

    def stop(self) -> None:
        """Kill what this soak started, and only that: its descendants (orphans included: it is their
        subreaper) and the process groups of its services."""
        self.stopping = True
        for component in self.components.values():
            for pgid in component.pgids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
        for _ in range(3):
            for pid in descendants(os.getpid()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
            for component in self.components.values():
                if component.process is not None:
                    component.process.poll()
            _reap_orphans(self._managed())
        with contextlib.suppress(Exception):
            self.instance.dispose()
        if getattr(self, "pool", None):
            shutil.rmtree(self.pool, ignore_errors=True)

    # -- Dagster's view --

    def _runs(self, **filters: Any) -> list[Any]:
        import dagster as dg

        for attempt in range(5):
            try:
                return list(self.instance.get_runs(filters=dg.RunsFilter(**filters)))
            except Exception:  # SQLite busy under the services' writes: read again
                if attempt == 4:
                    raise
                time.sleep(0.5)
        return []

    def _run_worker(self, run: Any) -> int | None:
        import dagster as dg

        starts = self.instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_START)
        pid = starts[-1].dagster_event.pid if starts and starts[-1].dagster_event else None
        return pid if pid and alive(pid) and pid in descendants(os.getpid()) else None

    def _started_runs(self) -> list[tuple[Any, int]]:
        """Started runs of unfinished jobs not yet hit, with their live worker's pid."""
        import dagster as dg

        found = []
        for run in self._runs(statuses=[dg.DagsterRunStatus.STARTED], job_name="batch_completions"):
            job_id = run.tags.get(JOB_ID_TAG)
            if job_id in self.hit_runs or job_id in self.finished:
                continue
            if (pid := self._run_worker(run)) is not None:
                found.append((run, pid))
        return found

    # -- faults --

    def _kill_and_restart(self, name: str, down_s: float, group: bool) -> None:
        with self.lock:
            self.down.add(name)
            self.components[name].kill(group=group)
            time.sleep(down_s)
            self.restart(name)

    def inject(self, kind: str) -> Fault | None:
        """Strike one fault of `kind`; None where nothing it needs is there now (no run queued, started...)."""
        at = time.monotonic() - self.started
        rng = self.rng
        if kind in ("api", "daemon", "code_server"):
            down = rng.uniform(0.5, 5.0)
            self._kill_and_restart(kind, down, group=kind != "code_server")
            return Fault(kind, at, kind, f"down {down:.1f} s")
        if kind == "code_server_at_dequeue":
            # A run queued while a run slot is free: the queue daemon dequeues it within its interval.
            import dagster as dg

            queued_statuses = [dg.DagsterRunStatus.QUEUED]
            busy_statuses = [dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED]
            deadline = time.monotonic() + 90
            while True:
                queued = self._runs(statuses=queued_statuses, job_name="batch_completions")
                if queued and len(self._runs(statuses=busy_statuses)) < self.config.max_concurrent_runs:
                    break
                if time.monotonic() > deadline or self.all_finished():
                    return None
                time.sleep(0.05)
            down = rng.uniform(3.0, 8.0)
            self._kill_and_restart("code_server", down, group=False)
            hit = [run.run_id for run in queued if self._dequeue_met_the_outage(run.run_id)]
            return Fault(
                kind,
                at,
                f"{len(queued)} queued, a slot free",
                f"down {down:.1f} s; dequeues that met it: {len(hit)}",
            )
        if kind in ("run_worker", "orphaned_run_worker"):
            candidates = self._started_runs()
            if not candidates:
                return None
            run, pid = rng.choice(candidates)
            job_id = run.tags[JOB_ID_TAG]
            self.hit_runs.add(job_id)
            detail = ""
            with self.lock:
                if kind == "orphaned_run_worker":
                    server = self.components["code_server"]
                    if pid not in descendants(server.pid):
                        self.hit_runs.discard(job_id)
                        return None  # started by an earlier server: not the case this fault is about
                    self.down.add("code_server")
                    server.kill(group=False)  # the run worker lives on, orphaned
                    self.restart("code_server")
                    detail = "code server restarted, then "
                killed_at = time.monotonic()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            fault = Fault(kind, at, f"{self._name_of(job_id)} run {run.run_id[:8]} pid {pid}", detail + "killed")
            fault.detect_s, fault.ok = self._await_detection(run.run_id, killed_at)
            fault.detail += f"; run failed after {fault.detect_s:.1f} s" if fault.detect_s is not None else ""
            return fault
        if kind == "orphaned_run_worker_while_loading":
            return self._orphan_killed_while_loading()
        if kind == "shard_worker":
            # A warm pool worker's shard of these small jobs lasts a second or two: watched for, not sampled.
            watch_until = time.monotonic() + SHARD_WATCH_S
            while not (workers := self._shard_workers()):
                if time.monotonic() > watch_until or self.all_finished():
                    return None
                time.sleep(0.05)
            pid, job_id, how = rng.choice(workers)
            self.hit_shards.add(job_id)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return Fault(kind, at, f"{self._name_of(job_id)} pid {pid}", f"{how} killed mid-generation")
        raise ValueError(kind)

    def _shard_workers(self) -> list[tuple[int, str, str]]:
        """The shard workers on a shard of a job no fault has hit: each one's pid, job and kind."""
        workers = []
        for pid in descendants(os.getpid()):
            command = _cmdline(pid)
            if "-m" in command and "batch_pipeline.worker" in command and alive(pid):
                job_id, how = self._shard_of(pid, command)
                if job_id and job_id not in self.hit_shards and job_id not in self.hit_runs:
                    workers.append((pid, job_id, how))
        return workers

    def _shard_of(self, pid: int, command: list[str]) -> tuple[str | None, str]:
        """The job whose shard worker `pid` runs, and what kind of worker it is: a launched one (its Pipes
        context is in its environment), or one of the warm engine pool (its `busy` file names the shard's
        log, in the job's work dir), warm when its engine had served a shard before."""
        if "--pool" not in command:
            run_id = _pipes_run_id(pid)
            run = self.instance.get_run_by_id(run_id) if run_id else None
            return (run.tags.get(JOB_ID_TAG) if run else None), "a launched worker"
        from batch_pipeline.shards.protocol import POOL_BUSY, PoolWorkerBusy

        directory = Path(command[command.index("--pool") + 1])
        try:
            busy = PoolWorkerBusy.model_validate_json((directory / POOL_BUSY).read_text())
        except (OSError, ValueError):  # waiting, not on a shard
            return None, ""
        parts = Path(busy.log).parts
        job_id = parts[parts.index("shards") - 1] if "shards" in parts else None
        return job_id, "a warm pool worker" if busy.shards_before else "a pool worker started for it"

    def _orphan_killed_while_loading(self) -> Fault | None:
        """The code server killed and started again at once; 1 s after the kill, the run worker it left behind,
        while the new code server still loads its definitions (issue 50)."""
        server = self.components["code_server"]
        candidates = [(run, pid) for run, pid in self._started_runs() if pid in descendants(server.pid)]
        if not candidates:
            return None
        run, pid = self.rng.choice(candidates)
        job_id = run.tags[JOB_ID_TAG]
        self.hit_runs.add(job_id)
        restart_after = self.rng.uniform(0.0, 0.9)
        with self.lock:
            self.down.add("code_server")
            server.kill(group=False)  # the run worker lives on, orphaned
            struck = time.monotonic()
            time.sleep(restart_after)
            server.start()  # loading its definitions from now on
            time.sleep(max(0.0, struck + 1.0 - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            self._wait(lambda: self._grpc_healthy(server), 180, "the code server did not come up")
            self.down.discard("code_server")
            answered = time.monotonic()
            loaded_s = answered - struck
        fault = Fault(
            "orphaned_run_worker_while_loading",
            struck - self.started,
            f"{self._name_of(job_id)} run {run.run_id[:8]} pid {pid}",
            f"code server killed, started again after {restart_after:.1f} s (answering after {loaded_s:.1f} s); "
            "its orphaned run worker killed 1 s after the kill",
        )
        fault.detect_s, _ = self._await_detection(run.run_id, killed_at)
        if fault.detect_s is not None:
            # As seen here, run monitoring fails such a run only once the new code server answers (the detection
            # was its load time, 31-76 s on a loaded machine): the bound counts from then.
            after_answer = killed_at + fault.detect_s - answered
            fault.ok = after_answer <= self.config.detect_bound_s
            fault.detail += (
                f"; run failed after {fault.detect_s:.1f} s ({max(0.0, after_answer):.1f} s after the code server "
                f"answered); {self._retry_outcome(run.run_id)}"
            )
        else:
            fault.ok = False
        return fault

    def _retry_outcome(self, run_id: str) -> str:
        """Whether the run retry daemon's first retry of the failed run met the code location down."""
        import dagster as dg

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            engine_events = self.instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)
            if any(record.message == "Failed to retry run" for record in engine_events):
                return "its retry met the outage"
            run = self.instance.get_run_by_id(run_id)
            if run is not None and run.tags.get("dagster/auto_retry_run_id"):
                return "retried at once"
            time.sleep(0.5)
        return "no retry within 30 s"

    def _dequeue_met_the_outage(self, run_id: str) -> bool:
        return any(
            "failed to reach the user code server" in (record.message or "")
            for record in self.instance.all_logs(run_id)
        )

    def _await_detection(self, run_id: str, killed_at: float) -> tuple[float | None, bool]:
        """Seconds until run monitoring failed the run (or it ended otherwise), and whether within the bound."""
        bound = self.config.detect_bound_s
        while time.monotonic() < killed_at + max(bound * 2, 120):
            run = self.instance.get_run_by_id(run_id)
            if run is not None and run.is_finished:
                took = time.monotonic() - killed_at
                return took, took <= bound
            time.sleep(0.5)
        return None, False

    def _name_of(self, job_id: str) -> str:
        return next((name for name, known in self.job_ids.items() if known == job_id), job_id[:14])

    def fault_loop(self, target: int) -> None:
        """Faults until `target` struck and every kind once, while jobs are unfinished."""
        kinds = list(SCENARIOS[self.config.scenario])
        plan = kinds + [self.rng.choice(kinds) for _ in range(max(0, target - len(kinds)))]
        self.rng.shuffle(plan)
        deferred = 0
        while plan and not STOP.is_set() and time.monotonic() < self.deadline and not self.all_finished():
            STOP.wait(self.rng.uniform(*self.config.gap_s))
            if self.all_finished():
                break
            kind = plan.pop(0)
            try:
                fault = self.inject(kind)
            except Exception as exc:  # a fault the soak could not strike, or a service that would not restart
                self.log(f"fault {kind} raised {exc!r}")
                self.client_problems.setdefault("deployment", []).append(f"fault {kind}: {exc!r}")
                fault = None
                self._restore()
            if fault is None:  # nothing it needs is there now: the others first, then it again
                deferred += 1
                if deferred < 200:
                    plan.append(kind)
                continue
            self.faults.append(fault)
            self.log(f"FAULT {fault.kind}: {fault.target} {fault.detail}{'' if fault.ok else ' (BOUND MISSED)'}")

    def _restore(self) -> None:
        with self.lock:
            for name, component in self.components.items():
                if not component.running():
                    with contextlib.suppress(Exception):
                        self.restart(name)

    # -- clients --

    def all_finished(self) -> bool:
        return len(self.specs) == self.config.jobs and len(self.finished) >= self.config.jobs

    def submit(self, spec: JobSpec) -> str | None:
        """POST until answered (retrying connection errors and 5xx), then once more with the same key, which
        must name the same job."""
        headers = {"Idempotency-Key": spec.key}
        job_ids = []
        for _ in range(2):
            while time.monotonic() < self.deadline:
                self.attempts[spec.name] = self.attempts.get(spec.name, 0) + 1
                try:
                    response = httpx.post(f"{self.api}{spec.route}", json=spec.body, headers=headers, timeout=30)
                except httpx.TransportError:
                    time.sleep(0.5)
                    continue
                if response.status_code >= 500:
                    self.client_problems.setdefault(spec.name, []).append(f"POST {response.status_code}")
                    time.sleep(0.5)
                    continue
                if response.status_code != 200:
                    self.client_problems.setdefault(spec.name, []).append(
                        f"POST {response.status_code}: {response.text[:300]}"
                    )
                    return None
                job_ids.append(response.json()["job_id"])
                break
        if len(set(job_ids)) != 1:
            self.client_problems.setdefault(spec.name, []).append(f"the same key named jobs {job_ids}")
        return job_ids[0] if job_ids else None

    def job_done(self, job_id: str) -> bool:
        """Completed, or failed or cancelled with no run of it still going (a failed run handed back to the
        retry daemon sets its job running again)."""
        record = self.store.get(job_id)
        if record is None or record.status not in ("completed", "failed", "cancelled"):
            return False
        if record.status == "completed":
            return True
        return all(run.is_finished for run in self._runs(tags={JOB_ID_TAG: job_id}))

    def client_loop(self) -> None:
        kinds = list(JOB_KINDS)
        order = kinds * (self.config.jobs // len(kinds)) + kinds[: self.config.jobs % len(kinds)]
        self.rng.shuffle(order)
        failed_since: dict[str, float] = {}
        while not STOP.is_set() and time.monotonic() < self.deadline:
            self.supervise()
            unfinished = [job_id for job_id in self.job_ids.values() if job_id not in self.finished]
            for job_id in unfinished:
                if self.job_done(job_id):
                    record = self.store.get(job_id)
                    if record is not None and record.status == "completed":
                        self.finished.add(job_id)
                    elif time.monotonic() - failed_since.setdefault(job_id, time.monotonic()) > 30:
                        self.finished.add(job_id)  # failed for good
                else:
                    failed_since.pop(job_id, None)
            if len(self.specs) < self.config.jobs and len(unfinished) < self.config.in_flight:
                index = len(self.specs)
                spec = job_spec(
                    order[index],
                    f"{index:02d}-{order[index]}",
                    self.out_dir,
                    self.rng,
                    self.config.prompts,
                    self.config.max_tokens,
                )
                self.specs.append(spec)
                submitted = self.submit(spec)
                if submitted is None:
                    self.finished.add(f"unsubmitted:{spec.name}")
                else:
                    self.job_ids[spec.name] = submitted
                    self.log(f"submitted {spec.name} as {submitted}")
                continue
            if self.all_finished():
                return
            time.sleep(1)

    # -- the whole soak --

    def run(self) -> dict[str, Any]:
        self.start()
        faults = threading.Thread(target=self._fault_thread, daemon=True)
        faults.start()
        self.client_loop()
        faults.join(timeout=300)
        timed_out = time.monotonic() >= self.deadline
        # Every service up again before the checks (the API's GET among them).
        with self.lock:
            self._restore()
        results = [self.check_job(spec) for spec in self.specs]
        wall = time.monotonic() - self.started
        return {
            "seed": self.config.seed,
            "config": asdict(self.config),
            "root": str(self.root),
            "wall_s": round(wall, 1),
            "timed_out": timed_out,
            "interrupted": STOP.is_set(),
            "jobs": [asdict(result) | {"ok": result.ok} for result in results],
            "faults": [asdict(fault) for fault in self.faults],
            "deployment_problems": self.client_problems.get("deployment", []),
            "specs": [asdict(spec) | {"job_id": self.job_ids.get(spec.name)} for spec in self.specs],
            "events": self.events,
        }

    def _fault_thread(self) -> None:
        try:
            self.fault_loop(max(self.config.faults, len(SCENARIOS[self.config.scenario])))
        except Exception as exc:
            self.log(f"the fault loop stopped: {exc!r}")
            self.client_problems.setdefault("deployment", []).append(f"fault loop: {exc!r}")

    # -- the checks --

    def _overlapping_runs(self, job_id: str) -> list[str]:
        """A job's runs live one after another: each starts after the one before it ended."""
        import dagster as dg

        records = self.instance.get_run_records(filters=dg.RunsFilter(tags={JOB_ID_TAG: job_id}))
        spans = sorted(
            (record.start_time, record.end_time or float("inf"), record.dagster_run.run_id)
            for record in records
            if record.dagster_run.job_name == "batch_completions" and record.start_time is not None
        )
        for (_, ended, before), (started, _, after) in zip(spans, spans[1:]):
            if started < ended:
                return [f"runs {before[:8]} and {after[:8]} were live at once"]
        return []

    def check_job(self, spec: JobSpec) -> JobResult:
        import dagster as dg
        import sqlalchemy as sa

        result = JobResult(spec.name, spec.kind, len(spec.markers), submit_attempts=self.attempts.get(spec.name, 0))
        problems = result.problems
        problems += self.client_problems.get(spec.name, [])
        job_id = self.job_ids.get(spec.name)
        if job_id is None:
            problems.append("never submitted")
            return result
        result.job_id = job_id
        with self.store.engine.connect() as connection:
            result.rows_for_key = connection.execute(
                sa.text("SELECT count(*) FROM batch_jobs WHERE idempotency_key = :key"), {"key": spec.key}
            ).scalar_one()
        if result.rows_for_key != 1:
            problems.append(f"{result.rows_for_key} rows for its Idempotency-Key")
        record = self.store.get(job_id)
        result.status = record.status if record else "missing"
        if result.status != "completed":
            problems.append(f"status {result.status}: {record.failure_reason if record else ''}")
        runs = [run for run in self._runs(tags={JOB_ID_TAG: job_id}) if run.job_name == "batch_completions"]
        result.runs = len(runs)
        result.successful_runs = sum(run.status == dg.DagsterRunStatus.SUCCESS for run in runs)
        result.retries = sum(1 for run in runs if run.parent_run_id)
        for run in runs:
            if run.status == dg.DagsterRunStatus.SUCCESS:
                for output in self.instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_OUTPUT):
                    if (output.step_key or "").startswith("run_shard") and output.dagster_event is not None:
                        value = output.dagster_event.step_output_data.metadata.get("resumed")
                        result.resumed += int(value.value) if value is not None else 0
        if result.successful_runs != 1:
            problems.append(f"{result.successful_runs} successful runs of {len(runs)}")
        if any(not run.is_finished for run in runs):
            problems.append("a run of it is still going")
        problems += self._overlapping_runs(job_id)
        for _ in range(30):
            try:
                api_status = httpx.get(f"{self.api}/v2/batch-completions/{job_id}", timeout=10).json()["job"]["status"]
                break
            except (httpx.TransportError, ValueError, KeyError):
                time.sleep(1)
        else:
            api_status = "unanswered"
        if api_status != "completed":
            problems.append(f"the API says {api_status}")
        problems += check_output(spec, job_id)
        problems += stray_files(Path(spec.output).parent, {"output.json", "output.json.metadata.json"})
        problems += stray_files(self.home / "work" / job_id, None)
        return result


def _prompt_tokens(entry: dict[str, Any]) -> int:
    if "num_prompt_tokens" in entry:
        return int(entry["num_prompt_tokens"])
    return int(entry["usage"]["prompt_tokens"])


def _text(entry: dict[str, Any]) -> str:
    if "text" in entry:
        return str(entry["text"])
    choice = entry["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


def check_output(spec: JobSpec, job_id: str) -> list[str]:
    """The output has exactly one entry per request, none an error, in input order by the markers, copies
    equal to their source; the metadata file names the job and its n."""
    problems: list[str] = []
    try:
        entries = json.loads(Path(spec.output).read_text())
    except (OSError, ValueError) as exc:
        return [f"output unreadable: {exc}"]
    n = len(spec.markers)
    if not isinstance(entries, list) or len(entries) != n:
        return [f"output has {len(entries) if isinstance(entries, list) else 'no list of'} entries, not {n}"]
    errors = [index for index, entry in enumerate(entries) if "error" in entry]
    if errors:
        return [f"error entries at {errors}: {entries[errors[0]]['error']}"]
    tokens = [_prompt_tokens(entry) for entry in entries]
    for i in range(n):
        for j in range(n):
            if (spec.markers[i] < spec.markers[j]) != (tokens[i] < tokens[j]):
                problems.append(f"out of order: entries {i} and {j} (markers {spec.markers[i]}, {spec.markers[j]})")
                break
        if problems:
            break
    if spec.kind in ("completion", "repeats"):  # echo: the text begins with the prompt, marker and all
        for index, (marker, entry) in enumerate(zip(spec.markers, entries)):
            if not _text(entry).startswith(prompt(marker)):
                problems.append(f"entry {index} does not echo its prompt (marker {marker})")
                break
    if spec.kind == "repeats":
        by_marker: dict[int, str] = {}
        for index, (marker, entry) in enumerate(zip(spec.markers, entries)):
            if by_marker.setdefault(marker, _text(entry)) != _text(entry):
                problems.append(f"entry {index} differs from its source (marker {marker})")
    if any(
        entry.get("num_completion_tokens", entry.get("usage", {}).get("completion_tokens", 0)) < 1 for entry in entries
    ):
        problems.append("an entry has no completion tokens")
    try:
        metadata = json.loads(Path(spec.output + ".metadata.json").read_text())
    except (OSError, ValueError) as exc:
        return problems + [f"metadata unreadable: {exc}"]
    if metadata.get("job_id") != job_id or int(metadata.get("num_requests", -1)) != n:
        problems.append(f"metadata names {metadata.get('job_id')} with {metadata.get('num_requests')} requests")
    if int(metadata.get("num_errors", 0)) != 0:
        problems.append(f"metadata counts {metadata.get('num_errors')} errors")
    return problems


def stray_files(directory: Path, allowed: set[str] | None) -> list[str]:
    """Partial or temporary files under `directory` (and, where `allowed` is given, any file not in it)."""
    stray = []
    for path in sorted(directory.rglob("*")) if directory.exists() else []:
        name = path.name
        if path.is_file() and (
            name.endswith((".partial", ".tmp")) or ".tmp" in name or (allowed is not None and name not in allowed)
        ):
            stray.append(str(path.relative_to(directory.parent)))
    return [f"stray files: {stray}"] if stray else []


# --- reporting ------------------------------------------------------------------------------------------


def table(rows: list[list[Any]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def report(result: dict[str, Any]) -> str:
    jobs, faults = result["jobs"], result["faults"]
    job_rows = [
        [
            job["name"],
            job["n"],
            job["status"],
            job["rows_for_key"],
            f"{job['successful_runs']}/{job['runs']}",
            job["retries"],
            job.get("resumed", 0),
            job["submit_attempts"],
            "ok" if job["ok"] else "FAIL: " + "; ".join(job["problems"])[:300],
        ]
        for job in jobs
    ]
    header = ["job", "n", "status", "rows/key", "ok runs/runs", "retries", "resumed", "POSTs", "check"]
    kinds = SCENARIOS[result["config"].get("scenario", "random")]
    by_kind = {kind: [f for f in faults if f["kind"] == kind] for kind in kinds}
    fault_rows = []
    for kind, struck in by_kind.items():
        detects = [f["detect_s"] for f in struck if f["detect_s"] is not None]
        fault_rows.append(
            [
                kind,
                len(struck),
                f"{max(detects):.1f}" if detects else "",
                "ok" if all(f["ok"] for f in struck) else "BOUND MISSED",
            ]
        )
    summary = summary_line(result)
    return (
        f"seed {result['seed']}\n\n{table(job_rows, header)}\n\n"
        f"{table(fault_rows, ['fault', 'struck', 'slowest detection s', 'bound'])}\n\n{summary}"
    )


def summary_line(result: dict[str, Any]) -> str:
    jobs, faults = result["jobs"], result["faults"]
    kinds = SCENARIOS[result["config"].get("scenario", "random")]
    counts = ", ".join(f"{kind} {sum(f['kind'] == kind for f in faults)}" for kind in kinds)
    once = sum(job["ok"] for job in jobs)
    return (
        f"seed {result['seed']}: {len(jobs)} jobs, {len(faults)} faults ({counts}); completed exactly once: "
        f"{once}/{len(jobs)}; deployment problems: {result['deployment_problems'] or 'none'}; "
        f"wall {result['wall_s']:.0f} s{' (DEADLINE)' if result['timed_out'] else ''}"
        f"{' (INTERRUPTED)' if result.get('interrupted') else ''}"
    )


def passed(result: dict[str, Any], config: SoakConfig) -> bool:
    kinds = {fault["kind"] for fault in result["faults"]}
    return (
        not result["timed_out"]
        and not result.get("interrupted")
        and len(result["jobs"]) == config.jobs
        and all(job["ok"] for job in result["jobs"])
        and all(fault["ok"] for fault in result["faults"])
        and kinds == set(SCENARIOS[config.scenario])
        and len(result["faults"]) >= config.faults
        and not result["deployment_problems"]
    )


def run_soak(config: SoakConfig) -> dict[str, Any]:
    soak = Soak(config)
    try:
        result = soak.run()
    finally:
        soak.stop()
    result["passed"] = passed(result, config)
    if result["passed"] and not config.keep and config.work_dir is None:
        shutil.rmtree(soak.root, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="random", help="which faults strike")
    parser.add_argument("--seed", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--jobs", type=int, default=24)
    parser.add_argument("--faults", type=int, default=24)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--max-concurrent-runs", type=int, default=2, help="the run queue's slots (shipped: 2)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--gap-s", type=float, nargs=2, default=[4.0, 12.0])
    parser.add_argument("--deadline-s", type=float, default=1800.0)
    parser.add_argument("--detect-bound-s", type=float, default=60.0)
    parser.add_argument(
        "--code-root", default=None, help="run this checkout's batch_pipeline (e.g. `git archive HEAD` unpacked)"
    )
    parser.add_argument("--work-dir", default=None, help="keep everything here (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory even when it passes")
    parser.add_argument("--json", default=None, help="write the results here (default: bench/results/)")
    args = parser.parse_args(argv)
    if args.code_root:  # this process reads the job store and starts the storage with that code too
        sys.path.insert(0, str(Path(args.code_root).resolve()))
        args.code_root = str(Path(args.code_root).resolve())

    def interrupted(*_: object) -> None:
        if STOP.is_set():
            raise KeyboardInterrupt  # a second time: stop now (run_soak's cleanup still kills what it started)
        STOP.set()  # the first: check the jobs submitted so far, and report them

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    results = []
    for seed in args.seed:
        if STOP.is_set():
            break
        config = SoakConfig(
            seed=seed,
            scenario=args.scenario,
            jobs=args.jobs,
            faults=args.faults,
            in_flight=args.in_flight,
            max_concurrent_runs=args.max_concurrent_runs,
            prompts=args.prompts,
            max_tokens=args.max_tokens,
            gap_s=(args.gap_s[0], args.gap_s[1]),
            deadline_s=args.deadline_s,
            detect_bound_s=args.detect_bound_s,
            work_dir=f"{args.work_dir}/seed{seed}" if args.work_dir else None,
            keep=args.keep,
            code_root=args.code_root,
        )
        result = run_soak(config)
        print(report(result), flush=True)
        results.append(result)
    out = Path(args.json) if args.json else RESULTS / f"chaos_soak-{datetime.now(UTC):%Y%m%dT%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    for result in results:
        print(summary_line(result) + ("  PASSED" if result["passed"] else "  FAILED"), flush=True)
    return 0 if all(result["passed"] for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
