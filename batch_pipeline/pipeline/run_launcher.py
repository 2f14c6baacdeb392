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
nothing elsewhere; and a process holding that pid now but started after the event is another process.
"""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path

import dagster as dg
from dagster._core.launcher import CheckRunHealthResult, DefaultRunLauncher, WorkerStatus
from dagster._core.storage.tags import GRPC_INFO_TAG

# /proc's process start times count from boot in clock ticks, and the boot time is whole seconds.
_START_TIME_SLACK_S = 2.0
PROC = Path("/proc")


class LocalRunLauncher(DefaultRunLauncher):
    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: dg.DagsterRun) -> CheckRunHealthResult:
        if not launched_on_this_machine(run):
            return CheckRunHealthResult(WorkerStatus.RUNNING, "launched by a code server elsewhere: not checked")
        starts = self._instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_START)
        event = starts[-1].dagster_event if starts else None
        if event is None or event.pid is None:  # not started yet, or by a writer that records no pid
            return CheckRunHealthResult(WorkerStatus.RUNNING, "no run worker pid recorded yet")
        if process_alive_since(event.pid, starts[-1].timestamp):
            return CheckRunHealthResult(WorkerStatus.RUNNING, run_worker_id=str(event.pid))
        return CheckRunHealthResult(
            WorkerStatus.FAILED,
            f"the run worker (pid {event.pid}) has exited without ending the run",
            run_worker_id=str(event.pid),
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


def process_alive_since(pid: int, since: float) -> bool:
    """Whether process `pid` runs and started no later than `since` (epoch seconds): the same process as
    then, not one that was given its pid later. Where it cannot tell, it says alive: a run is never failed
    on a doubt."""
    if not (PROC / "stat").exists():  # no /proc (macOS): existence alone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    # After the command name, which may hold spaces and parentheses: state is field 3, starttime field 22.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):  # exited, not yet reaped
        return False
    started = _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return started <= since + _START_TIME_SLACK_S


def _boot_time() -> float:
    for line in (PROC / "stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return 0.0
