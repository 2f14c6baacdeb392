"""The embedded deployment's run launcher: Dagster's DefaultRunLauncher, plus a health check of each run's
worker process, so that Dagster's run monitoring finds a run whose worker is gone whoever launched it.

Dagster's DefaultRunLauncher starts a run worker through the code server, and only that server watches the
process: a run worker orphaned by a restarted code server, then killed, left its run STARTED until its
`dagster/max_runtime` (a day by default), holding a run slot all the while. Here the run monitoring daemon
(`run_monitoring` in dagster.yaml, every `poll_interval_seconds`) asks `check_run_worker_health`; a run
whose worker has exited is marked failed, and the run retry daemon re-executes it from failure, which
resumes the job from its shards' checkpoints.

The run worker is the process that wrote the run's RUN_START event (its `pid`). It is checked only for a
run launched through a code server on this machine (a loopback address or a socket), since a pid means
nothing elsewhere; and a process holding that pid now but started after the event is another process. It
assumes what `make serve` gives: the daemon sees the run workers' processes (one machine, one PID namespace).
Where it cannot tell (no /proc, /proc hiding other processes) it says the worker runs: a run is never failed
on a doubt.

A run can also be failed while its worker runs: a StartRun that a code server still loading took after the
queue had given up on it starts a second worker, which finds the run started and exits, and the code server
then fails the run for that worker's exit (a soak of issue 50 saw it). Before a retry of a run is launched,
the earlier run's worker, where it still runs on this machine, is stopped: a job never has two live runs.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import time
from pathlib import Path

import dagster as dg
from dagster._core.launcher import CheckRunHealthResult, DefaultRunLauncher, LaunchRunContext, WorkerStatus
from dagster._core.storage.tags import GRPC_INFO_TAG
from dagster._serdes.config_class import ConfigurableClassData

from batch_pipeline.pipeline.retries import is_retry_of_completed

# The first time a run's worker is seen, its start (boot time, which moves when the wall clock is stepped,
# plus /proc's clock ticks) is held against the RUN_START event's wall-clock time with this much slack; from
# then on, its start in ticks alone, which no clock step moves.
FIRST_SIGHT_SLACK_S = 60.0
PROC = Path("/proc")
# How long an earlier run's worker has to stop on SIGTERM (its steps stop their shard workers) before SIGKILL.
STALE_WORKER_GRACE_S = 30.0


class LocalRunLauncher(DefaultRunLauncher):
    def __init__(self, inst_data: ConfigurableClassData | None = None) -> None:
        super().__init__(inst_data=inst_data)
        self._worker_starts: dict[tuple[str, int], int] = {}  # (run id, pid) -> its start, in clock ticks

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def launch_run(self, context: LaunchRunContext) -> None:
        parent_id = context.dagster_run.parent_run_id
        parent = self._instance.get_run_by_id(parent_id) if parent_id else None
        if parent is not None:
            self.stop_stale_worker(parent)
            parent = self._instance.get_run_by_id(parent.run_id)
            if is_retry_of_completed(context.dagster_run, parent):
                # Failed from outside while its worker ran on, that worker then completed it (its job's output
                # written): a retry would only run the job a second time (found by bench/chaos_soak.py).
                self._instance.report_run_canceled(
                    context.dagster_run,
                    f"not run: the run it retries ({parent_id}) was failed while its worker ran on, and that "
                    "worker completed it",
                )
                return
        super().launch_run(context)

    def stop_stale_worker(self, run: dg.DagsterRun, grace_s: float = STALE_WORKER_GRACE_S) -> int | None:
        """Stop the worker of `run`, a finished run, where it still runs on this machine (SIGTERM, then SIGKILL
        after `grace_s`); the pid stopped, or None where no such worker runs."""
        if not run.is_finished or not launched_on_this_machine(run):
            return None
        starts = self._instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_START)
        event = starts[-1].dagster_event if starts else None
        if event is None or event.pid is None:
            return None
        pid, started = event.pid, starts[-1].timestamp
        ticks = process_start_ticks(pid)
        if ticks is None or ticks == UNKNOWN or not started_by(ticks, started + 1.0):
            return None  # exited, unknowable, or a later process holding its pid
        self._instance.report_engine_event(
            f"the run's worker (pid {pid}) still ran after the run ended: stopped before its retry starts", run
        )
        for sent, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.kill(pid, sent)
            except ProcessLookupError:
                return pid
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if process_start_ticks(pid) != ticks:
                    return pid
                time.sleep(0.2)
        return pid

    def check_run_worker_health(self, run: dg.DagsterRun) -> CheckRunHealthResult:
        if not launched_on_this_machine(run):
            return CheckRunHealthResult(WorkerStatus.RUNNING, "launched by a code server elsewhere: not checked")
        starts = self._instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_START)
        event = starts[-1].dagster_event if starts else None
        if event is None or event.pid is None:  # not started yet, or by a writer that records no pid
            return CheckRunHealthResult(WorkerStatus.RUNNING, "no run worker pid recorded yet")
        pid, key = event.pid, (run.run_id, event.pid)
        ticks = process_start_ticks(pid)
        if ticks == UNKNOWN:
            return CheckRunHealthResult(WorkerStatus.RUNNING, f"cannot tell whether pid {pid} runs")
        seen = self._worker_starts.get(key)
        if ticks is not None and seen is None and started_by(ticks, starts[-1].timestamp + FIRST_SIGHT_SLACK_S):
            self._worker_starts[key] = seen = ticks
        if ticks is not None and ticks == seen:
            return CheckRunHealthResult(WorkerStatus.RUNNING, run_worker_id=str(pid))
        self._worker_starts.pop(key, None)
        return CheckRunHealthResult(
            WorkerStatus.FAILED,
            f"the run worker (pid {pid}) has exited without ending the run",
            run_worker_id=str(pid),
        )


def launched_on_this_machine(run: dg.DagsterRun) -> bool:
    """Whether the code server that started the run's worker is on this machine, by the address the
    launcher reached it at (DefaultRunLauncher records it as a run tag)."""
    try:
        info = json.loads(run.tags.get(GRPC_INFO_TAG, ""))
    except ValueError:
        return False
    if not isinstance(info, dict):
        return False
    if info.get("socket"):
        return True
    host = str(info.get("host", ""))
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


UNKNOWN = -1


def process_start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot; None where no such process runs (or it has
    exited and is not yet reaped), UNKNOWN where it cannot be told (no /proc, or /proc hides it)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except FileNotFoundError:
        if not (PROC / "self" / "stat").exists():  # no /proc here at all
            return UNKNOWN
        return None
    except OSError:
        return UNKNOWN
    # After the command name, which may hold spaces and parentheses: state is field 3, starttime field 22.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def started_by(ticks: int, moment: float) -> bool:
    """Whether a process that started `ticks` after boot had started by `moment` (epoch seconds)."""
    return _boot_time() + ticks / os.sysconf("SC_CLK_TCK") <= moment


def process_alive_since(pid: int, since: float) -> bool:
    """Whether process `pid` runs and had started by `since` (with a second of slack for /proc's whole-second
    boot time): the same process as then, not one given its pid later."""
    ticks = process_start_ticks(pid)
    return ticks == UNKNOWN or (ticks is not None and started_by(ticks, since + 1.0))


def _boot_time() -> float:
    for line in (PROC / "stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return 0.0
