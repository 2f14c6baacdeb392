"""Dead run workers are found whoever launched them: the embedded deployment's run launcher
(pipeline/run_launcher.py) tells Dagster's run monitoring whether a run's worker process still runs."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import httpx
import pytest
import yaml
from dagster._core.launcher import LaunchRunContext, WorkerStatus
from dagster._core.storage.tags import GRPC_INFO_TAG

from batch_pipeline.pipeline.run_launcher import LocalRunLauncher, launched_on_this_machine, process_alive_since
from tests.api_fixtures import REPO
from tests.conftest import MODEL
from tests.entrypoints.test_serve import Served, _descendants, _free_port

LOCAL_GRPC = json.dumps({"host": "localhost", "port": 4266})


@dg.op
def _nothing() -> None:
    pass


@dg.job
def _a_job() -> None:
    _nothing()


@pytest.fixture
def instance(tmp_path):
    (tmp_path / "dagster.yaml").write_text(
        "run_launcher:\n  module: batch_pipeline.pipeline.run_launcher\n  class: LocalRunLauncher\n"
        "telemetry:\n  enabled: false\n"
    )
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        yield instance


def _started_run(instance: dg.DagsterInstance, pid: int | None, grpc_info: str = LOCAL_GRPC) -> dg.DagsterRun:
    """A run in the instance's storage as DefaultRunLauncher and a run worker leave it: the code server's
    address as a tag, then the worker's RUN_START event carrying its pid."""
    run = instance.create_run_for_job(_a_job)
    instance.add_run_tags(run.run_id, {GRPC_INFO_TAG: grpc_info})
    instance.report_dagster_event(
        dg.DagsterEvent(dg.DagsterEventType.RUN_START.value, job_name=run.job_name, pid=pid), run_id=run.run_id
    )
    return instance.get_run_by_id(run.run_id)


def test_a_run_whose_worker_process_has_exited_is_reported_failed_and_a_living_one_running(instance):
    assert isinstance(instance.run_launcher, LocalRunLauncher)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run = _started_run(instance, worker.pid)
        assert instance.run_launcher.supports_check_run_worker_health
        assert instance.run_launcher.check_run_worker_health(run).status == WorkerStatus.RUNNING
    finally:
        worker.kill()
        worker.wait()
    health = instance.run_launcher.check_run_worker_health(run)
    assert health.status == WorkerStatus.FAILED
    assert f"pid {worker.pid}" in health.msg


def test_a_failed_runs_worker_that_still_runs_is_stopped_before_its_retry_is_launched(instance):
    """A run failed while its worker ran on (a code server's second worker for it exited): its retry must
    not run beside it, so launching the retry stops that worker first; a running run's worker is never
    stopped, nor a finished run's pid once another process holds it."""
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        run = _started_run(instance, worker.pid)
        assert instance.run_launcher.stop_stale_worker(run) is None  # running: its worker is its own
        instance.report_run_failed(run, "This run has been marked as failed from outside the execution context.")
        retry = instance.create_run_for_job(_a_job, parent_run_id=run.run_id, root_run_id=run.run_id)
        with contextlib.suppress(Exception):  # no code server here: the launch itself fails after the stop
            instance.run_launcher.launch_run(LaunchRunContext(dagster_run=retry, workspace=None))
        assert worker.wait(timeout=15) == -signal.SIGTERM
        events = [e.message for e in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)]
        assert any(f"pid {worker.pid}) still ran after the run ended" in (m or "") for m in events), events
    finally:
        worker.kill()
        worker.wait()
    assert instance.run_launcher.stop_stale_worker(instance.get_run_by_id(run.run_id)) is None  # gone now


def test_the_retry_of_a_run_its_worker_completed_after_it_was_failed_is_not_run(instance):
    """A run failed from outside while its worker ran on, which then completed it (its job's output written):
    its retry, dequeued after, would run the job a second time (bench/chaos_soak.py, seed 5). Not launched:
    cancelled, saying why."""
    run = _started_run(instance, None)
    instance.report_run_failed(run, "This run has been marked as failed from outside the execution context.")
    instance.report_dagster_event(
        dg.DagsterEvent(dg.DagsterEventType.RUN_SUCCESS.value, job_name=run.job_name), run_id=run.run_id
    )
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.SUCCESS  # its worker's last word
    retry = instance.create_run_for_job(
        _a_job,
        parent_run_id=run.run_id,
        root_run_id=run.run_id,
        status=dg.DagsterRunStatus.STARTING,
        tags={"dagster/retry_number": "1"},  # the run retry daemon's
    )
    # No code server here: a launch would raise. This one returns, having launched nothing.
    instance.run_launcher.launch_run(LaunchRunContext(dagster_run=retry, workspace=None))
    assert instance.get_run_by_id(retry.run_id).status == dg.DagsterRunStatus.CANCELED
    events = [e.message or "" for e in instance.all_logs(retry.run_id, of_type=dg.DagsterEventType.RUN_CANCELED)]
    assert any("that worker completed it" in message for message in events), events
    # An operator's re-execution of the completed run (no retry number) is theirs to run: it is launched.
    again = instance.create_run_for_job(
        _a_job, parent_run_id=run.run_id, root_run_id=run.run_id, status=dg.DagsterRunStatus.STARTING
    )
    with contextlib.suppress(Exception):  # launched: and with no code server here, the launch itself fails
        instance.run_launcher.launch_run(LaunchRunContext(dagster_run=again, workspace=None))
    assert instance.get_run_by_id(again.run_id).status != dg.DagsterRunStatus.CANCELED


def test_a_pid_taken_by_a_process_started_after_the_run_worker_is_not_the_run_worker(instance):
    run = _started_run(instance, os.getpid())  # this process, but the event says the worker started now
    started = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_START)[-1].timestamp
    assert not process_alive_since(os.getpid(), started - 3600)
    assert process_alive_since(os.getpid(), started)


def test_a_wall_clock_step_after_the_worker_was_first_seen_fails_no_run(instance, monkeypatch):
    """/proc's boot time moves with the wall clock: a run judged by it alone failed every living worker
    after an NTP step of a few seconds. Once seen, a worker is known by its start in clock ticks."""
    from batch_pipeline.pipeline import run_launcher

    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run = _started_run(instance, worker.pid)
        assert instance.run_launcher.check_run_worker_health(run).status == WorkerStatus.RUNNING
        stepped = run_launcher._boot_time() + 3600  # the clock stepped an hour forward
        monkeypatch.setattr(run_launcher, "_boot_time", lambda: stepped)
        assert instance.run_launcher.check_run_worker_health(run).status == WorkerStatus.RUNNING
        # A process that holds the pid with another start is not the worker, whatever the clock says.
        seen = instance.run_launcher._worker_starts
        seen[(run.run_id, worker.pid)] -= 1
        assert instance.run_launcher.check_run_worker_health(run).status == WorkerStatus.FAILED
    finally:
        worker.kill()
        worker.wait()


def test_a_zombie_is_not_a_living_worker():
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/stat").read_text().split(")")[-1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not process_alive_since(child.pid, time.time())
    child.wait()


def test_a_run_launched_through_a_code_server_elsewhere_or_with_no_pid_is_never_failed_on_a_doubt(instance):
    gone = subprocess.Popen(["true"])
    gone.wait()
    remote = _started_run(instance, gone.pid, json.dumps({"host": "code-server.batch.svc", "port": 4266}))
    assert instance.run_launcher.check_run_worker_health(remote).status == WorkerStatus.RUNNING
    no_pid = _started_run(instance, None)
    assert instance.run_launcher.check_run_worker_health(no_pid).status == WorkerStatus.RUNNING


@pytest.mark.parametrize(
    ("info", "local"),
    [
        ({"host": "localhost", "port": 1}, True),
        ({"host": "127.0.0.1", "port": 1}, True),
        ({"host": "::1", "port": 1}, True),
        ({"host": "", "socket": "/tmp/grpc.sock"}, True),
        ({"host": "10.0.0.7", "port": 1}, False),
        ({"host": "user-code.dagster.svc", "port": 1}, False),
    ],
)
def test_only_a_code_server_on_this_machine_counts_as_local(instance, info, local):
    run = _started_run(instance, os.getpid(), json.dumps(info))
    assert launched_on_this_machine(run) is local


def _code_server(port: int, home: Path, log: Path) -> subprocess.Popen:
    """A code server of its own, as a deployment that restarts it separately runs it."""
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "dagster"), "api", "grpc", "-m", "batch_pipeline.pipeline.definitions"]
        + ["-h", "127.0.0.1", "-p", str(port)],
        cwd=REPO,
        env={**os.environ, "DAGSTER_HOME": str(home), "BATCH_PIPELINE_SENSOR_INTERVAL_S": "1"},
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "api", "grpc-health-check", "-p", str(port)],
        capture_output=True,
    ).returncode:
        assert server.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the code server did not come up"
        time.sleep(1)
    return server


def deployment_with_its_own_code_server(tmp_path, poll_interval_seconds: int = 10, **coordinator):
    """`make serve`'s deployment, with the shipped dagster.yaml (one run slot, and `coordinator` over its
    run coordinator's config), whose code server runs apart, as a deployment that restarts it separately
    runs it. Returns the deployment, its DAGSTER_HOME, the code servers started so far (to kill at the
    end), and a function that starts another on the same port."""
    port = _free_port()
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(
        f"load_from:\n  - grpc_server:\n      host: 127.0.0.1\n      port: {port}\n"
        "      location_name: batch_pipeline\n"
    )
    shipped = yaml.safe_load((REPO / "dagster_home" / "dagster.yaml").read_text())
    shipped["run_coordinator"]["config"].update(max_concurrent_runs=1, dequeue_interval_seconds=1, **coordinator)
    shipped["run_monitoring"]["poll_interval_seconds"] = poll_interval_seconds
    home = tmp_path / "dagster_home"
    home.mkdir()
    log = tmp_path / "code_server.log"
    servers = [_code_server(port, home, log)]

    def restart() -> None:
        servers.append(_code_server(port, home, log))

    return Served(tmp_path, instance_yaml=yaml.safe_dump(shipped), workspace=workspace), home, servers, restart


@pytest.mark.slow
def test_a_run_worker_orphaned_by_a_code_server_restart_then_killed_is_found_and_its_job_resumed(tmp_path):
    """On main the run stayed STARTED, its job `running`, until its max_runtime (a day by default)."""
    served, home, servers, restart = deployment_with_its_own_code_server(tmp_path, poll_interval_seconds=2)
    try:
        served.wait_until_up()
        prompts = [f"Write a long story about the number {i}." for i in range(12)]
        request = {
            "output_data_path": str(tmp_path / "output.json"),
            "model_config": {"model": MODEL},
            "content": {"prompts": prompts, "max_new_tokens": 48, "temperature": 0.0},
        }
        created = httpx.post(f"{served.api}/v2/batch-completions", json=request, timeout=30)
        assert created.status_code == 200, created.text
        job_id = created.json()["job_id"]
        results = home / "work" / job_id / "shards" / "000" / "results.tsv"
        deadline = time.monotonic() + 300
        while not (results.exists() and results.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline, f"no results; serve log:\n{served.log.read_text()[-3000:]}"
            time.sleep(0.1)
        instance = dg.DagsterInstance.from_config(str(home))
        (run,) = instance.get_runs()
        worker_pid = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_START)[-1].dagster_event.pid
        assert worker_pid in _descendants(servers[0].pid)  # the code server started it, and only it watched it
        # Held where it stands: the job's other results come a moment after the first, and the run used to
        # end while the code server restarted (SUCCESS, nothing left to find).
        os.kill(worker_pid, signal.SIGSTOP)
        servers[0].kill()  # the run worker lives on, orphaned
        servers[0].wait()
        restart()
        os.kill(worker_pid, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while (job := httpx.get(f"{served.api}/v2/batch-completions/{job_id}", timeout=10).json()["job"])[
            "status"
        ] not in (
            "completed",
            "failed",
        ):
            assert time.monotonic() < deadline, f"the job stayed {job['status']}: {instance.get_run_by_id(run.run_id)}"
            time.sleep(1)
        assert job["status"] == "completed", job
        first = instance.get_run_by_id(run.run_id)
        assert first.status == dg.DagsterRunStatus.FAILURE
        messages = [record.message for record in instance.all_logs(run.run_id)]
        assert any(f"the run worker (pid {worker_pid}) has exited" in message for message in messages), messages
        output = json.loads((tmp_path / "output.json").read_text())
        assert len(output) == len(prompts)
        assert all("text" in entry and entry["num_completion_tokens"] >= 1 for entry in output), output  # no errors
        (retry,) = [other for other in instance.get_runs() if other.run_id != run.run_id]
        assert retry.parent_run_id == run.run_id  # the run retries daemon's re-execution from failure
        outputs = instance.all_logs(retry.run_id, of_type=dg.DagsterEventType.STEP_OUTPUT)
        (resumed,) = [
            record.dagster_event.step_output_data.metadata["resumed"].value
            for record in outputs
            if record.step_key.startswith("run_shard")
        ]
        assert resumed >= 2  # what the killed worker had checkpointed was kept, not generated again
    finally:
        served.kill()
        for server in servers:
            server.kill()


def _queued_run_coordinators() -> dict[str, tuple[str, str, dict]]:
    """(module, class, config) of the run coordinator in each shipped instance config."""
    local = yaml.safe_load((REPO / "dagster_home" / "dagster.yaml").read_text())["run_coordinator"]
    chart = yaml.safe_load((REPO / "k8s" / "values.yaml").read_text())["dagsterDaemon"]["runCoordinator"]
    assert chart["type"] == "CustomRunCoordinator"  # the chart's queuedRunCoordinator values cannot set retries
    custom = chart["config"]["customRunCoordinator"]
    return {
        "dagster_home/dagster.yaml": (local["module"], local["class"], local["config"]),
        "k8s/values.yaml": (custom["module"], custom["class"], custom["config"]),
    }


@pytest.mark.parametrize("shipped", ["dagster_home/dagster.yaml", "k8s/values.yaml"])
def test_the_shipped_run_queues_wait_out_a_code_server_down_for_a_minute(shipped):
    """On main a code server unreachable for the 50 ms of a dequeue failed the run for good."""
    from dagster._config import process_config
    from dagster._serdes.config_class import ConfigurableClassData

    module, name, config = _queued_run_coordinators()[shipped]
    coordinator_class = getattr(__import__(module, fromlist=[name]), name)
    checked = process_config(coordinator_class.config_type(), config)
    assert checked.success, checked.errors
    coordinator = coordinator_class.from_config_value(
        ConfigurableClassData(module, name, yaml.safe_dump(config)), checked.value
    )
    queue = coordinator.get_run_queue_config()
    assert queue.max_user_code_failure_retries * queue.user_code_failure_retry_delay >= 60


def test_the_embedded_instance_checks_its_run_workers():
    local = yaml.safe_load((REPO / "dagster_home" / "dagster.yaml").read_text())
    assert (local["run_launcher"]["module"], local["run_launcher"]["class"]) == (
        LocalRunLauncher.__module__,
        LocalRunLauncher.__name__,
    )
    assert local["run_monitoring"]["enabled"] and local["run_monitoring"]["poll_interval_seconds"] <= 60
    assert local["run_retries"]["enabled"] and local["run_retries"]["max_retries"] >= 1
