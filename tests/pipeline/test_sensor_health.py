"""What the Dagster UI shows beside `batch_jobs_sensor` reads healthy while the sensor is (issue 46, item 12).

The Automation page shows, beside each sensor, the status of the latest run it launched (a red icon: that run
failed) and its latest tick (a warning: the tick failed). Every job's run is the jobs sensor's, so a run that
"fails" when nothing failed reads as a broken sensor. These go through Dagster's own machinery, in this
process and against a real instance with the shipped dagster.yaml: the sensor daemon's tick
(`execute_sensor_iteration`, which records the ticks), the run queue's dequeue, the run worker the run
launcher starts (no engine: the run stops in its first step), and the UI's own GraphQL query of the row."""

from __future__ import annotations

import logging
import time

import dagster as dg
import pytest
from dagster._core.scheduler.instigation import TickStatus
from dagster._core.test_utils import create_test_daemon_workspace_context
from dagster._core.workspace.load_target import ModuleTarget
from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon
from dagster._daemon.sensor import execute_sensor_iteration
from dagster_graphql.test.utils import execute_dagster_graphql

from tests.api.test_api import _body
from tests.api_fixtures import REPO, USER_KEY, Deployment

# A code server each, and the first a run worker: ~20 s apiece on 2 cores.
pytestmark = pytest.mark.slow
ALICE = {"x-api-key": USER_KEY}
LOCATION = "batch_pipeline.pipeline.definitions"
# The fields of the Automation page's row of a sensor (the UI's SingleSensorQuery): its latest tick and run.
SENSOR_ROW_QUERY = """
query SensorRow($selector: SensorSelector!) {
  sensorOrError(sensorSelector: $selector) {
    __typename
    ... on Sensor { sensorState { status ticks(limit: 1) { status } runs(limit: 1) { status } } }
  }
}"""


@pytest.fixture
def deployment(tmp_path, monkeypatch):
    home = tmp_path / "dagster_home"
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("BATCH_PIPELINE_JOBS_DB", f"sqlite:///{home}/batch_jobs.db")
    monkeypatch.setenv("BATCH_PIPELINE_SENSOR_INTERVAL_S", "1")
    shipped = (REPO / "dagster_home" / "dagster.yaml").read_text()  # the queue, LocalRunLauncher, monitoring
    deployment = Deployment(home, max_concurrent_runs=2, instance_yaml=shipped)
    yield deployment
    deployment.stop()


class Daemon:
    """The sensor daemon's and the run queue's iterations over the definitions' code location."""

    def __init__(self, workspace) -> None:
        self.workspace = workspace

    def tick_sensors(self) -> None:
        time.sleep(1.1)  # each sensor's minimum interval (BATCH_PIPELINE_SENSOR_INTERVAL_S=1)
        list(execute_sensor_iteration(self.workspace, logging.getLogger("sensor daemon"), None, None))

    def dequeue(self) -> None:
        list(QueuedRunCoordinatorDaemon(interval_seconds=1).run_iteration(self.workspace))

    def sensor_row(self) -> dict:
        selector = {"repositoryLocationName": LOCATION, "repositoryName": "__repository__"}
        result = execute_dagster_graphql(
            self.workspace.create_request_context(),
            SENSOR_ROW_QUERY,
            {"selector": {**selector, "sensorName": "batch_jobs_sensor"}},
        )
        assert result.errors is None, result.errors
        sensor = result.data["sensorOrError"]
        assert sensor["__typename"] == "Sensor", sensor
        return sensor["sensorState"]


def _jobs_sensor_ticks(instance: dg.DagsterInstance) -> list:
    (state,) = [state for state in instance.all_instigator_state() if state.instigator_name == "batch_jobs_sensor"]
    return instance.get_ticks(state.instigator_origin_id, state.selector_id)


def test_a_job_cancelled_as_the_sensor_asks_for_its_run_leaves_a_cancelled_run_not_a_failed_one(
    deployment, tmp_path, monkeypatch
):
    """The user's cancel lands between the sensor's read of the queued job and the daemon's creation of its run:
    the cancel finds no run, so the job is cancelled before launch, and the run made a moment later refuses to
    start. It refused with a failure: a failed run beside the sensor, though nothing failed."""
    target = ModuleTarget(module_name=LOCATION, attribute=None, working_directory=str(REPO), location_name=LOCATION)
    with create_test_daemon_workspace_context(target, deployment.instance) as workspace:
        daemon = Daemon(workspace)
        daemon.tick_sensors()  # nothing queued: a skipped tick
        job_id = deployment.client.post("/v2/batch-completions", json=_body(tmp_path), headers=ALICE).json()["job_id"]

        create_run = deployment.instance.create_run
        cancels = []

        def cancel_first(*args, **kwargs):
            # The sensor has read the job (this tick's run request is its); the run does not exist yet.
            if not cancels:
                cancel = deployment.client.post(f"/v2/batch-completions/{job_id}/actions/cancel", headers=ALICE)
                cancels.append(cancel.json())
            return create_run(*args, **kwargs)

        with monkeypatch.context() as patched:
            patched.setattr(deployment.instance, "create_run", cancel_first)
            daemon.tick_sensors()
        assert cancels == [{"success": True}]
        (run,) = deployment.instance.get_runs(filters=dg.RunsFilter(tags={"batch_pipeline/job_id": job_id}))

        daemon.dequeue()  # launched: its run worker starts, and its first step finds the job cancelled
        deadline = time.monotonic() + 120
        while not (run := deployment.instance.get_run_by_id(run.run_id)).is_finished:
            assert time.monotonic() < deadline, f"run {run.run_id} still {run.status}"
            time.sleep(0.5)
        assert run.status == dg.DagsterRunStatus.CANCELED
        daemon.tick_sensors()  # the run-status sensors record its end

        assert deployment.job(job_id)["status"] == "cancelled"
        row = daemon.sensor_row()
        assert row["status"] == "RUNNING"
        assert row["runs"] == [{"status": "CANCELED"}]  # grey in the UI; a failure is the red icon
        assert row["ticks"][0]["status"] in ("SKIPPED", "SUCCESS")
        statuses = {tick.status for tick in _jobs_sensor_ticks(deployment.instance)}
        assert TickStatus.FAILURE not in statuses and TickStatus.SUCCESS in statuses


def test_the_jobs_sensors_ticks_never_fail_through_a_newcomers_submit_cancel_and_resume(deployment, tmp_path):
    """Idle, jobs submitted, cancels of queued jobs, their resumes: every tick of the
    jobs sensor is skipped or succeeded (a failed tick is the UI's warning beside it), and the latest run it
    launched reads as what its job did."""
    target = ModuleTarget(module_name=LOCATION, attribute=None, working_directory=str(REPO), location_name=LOCATION)
    with create_test_daemon_workspace_context(target, deployment.instance) as workspace:
        daemon = Daemon(workspace)
        daemon.tick_sensors()
        jobs = [
            deployment.client.post("/v2/batch-completions", json=_body(tmp_path, f"out{n}"), headers=ALICE).json()[
                "job_id"
            ]
            for n in range(3)
        ]
        daemon.tick_sensors()
        daemon.tick_sensors()
        for job_id in jobs[:2]:
            cancel = deployment.client.post(f"/v2/batch-completions/{job_id}/actions/cancel", headers=ALICE)
            assert cancel.json() == {"success": True}
        daemon.tick_sensors()
        for job_id in jobs[:2]:
            resumed = deployment.client.post(f"/v2/batch-completions/{job_id}/actions/resume", headers=ALICE)
            assert resumed.status_code == 200, resumed.text
        daemon.tick_sensors()
        daemon.tick_sensors()

        ticks = _jobs_sensor_ticks(deployment.instance)
        assert [tick.error for tick in ticks if tick.status == TickStatus.FAILURE] == []
        assert sum(len(tick.run_ids) for tick in ticks) == 5  # three jobs, two resumes: a run each
        runs = deployment.instance.get_runs(filters=dg.RunsFilter(tags={"dagster/sensor_name": "batch_jobs_sensor"}))
        assert sorted(run.status.value for run in runs) == ["CANCELED", "CANCELED", "QUEUED", "QUEUED", "QUEUED"]
        row = daemon.sensor_row()
        assert row["runs"] == [{"status": "QUEUED"}] and row["ticks"][0]["status"] in ("SKIPPED", "SUCCESS")
