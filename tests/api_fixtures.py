"""A real local deployment for API tests: a Dagster instance in a temporary DAGSTER_HOME, the app over
HTTP (Starlette's TestClient drives the real ASGI app), and, where runs must execute, the real daemon."""

import atexit
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from batch_pipeline.admission.policy import AdmissionPolicy
from batch_pipeline.api.app import create_app
from batch_pipeline.api.auth import ApiKeys
from batch_pipeline.api.service import BatchJobService
from batch_pipeline.core.settings import settings
from batch_pipeline.pipeline.resources import JobStoreResource, RunLaunching, Tenancy
from batch_pipeline.store.engine import upgrade_schema
from batch_pipeline.store.jobs import JobStore

REPO = Path(__file__).resolve().parents[1]
USER_KEY, OTHER_KEY, ADMIN_KEY = "key-alice", "key-bob", "key-admin"


# The databases a fresh DAGSTER_HOME holds once its instance and job store have started: Dagster's run, event
# index and schedule storage, and the job store. Creating them (DDL and Alembic stamps) took a test ~1 s on
# 2 cores; a test's home starts with copies of ones created once per session instead, the same schema.
_DAGSTER_DATABASES = ("history/runs.db", "history/runs/index.db", "schedules/schedules.db")
_JOB_STORE_DATABASE = "batch_jobs.db"


@functools.cache
def _migrated_home() -> Path:
    home = Path(tempfile.mkdtemp(prefix="batch-pipeline-migrated-home-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    dg.DagsterInstance.from_config(str(home)).dispose()
    # Not through the store's engine: that one is kept for the process and turns on WAL, which would leave
    # the schema in a -wal file beside the one copied.
    engine = sa.create_engine(f"sqlite:///{home}/{_JOB_STORE_DATABASE}")
    upgrade_schema(engine)
    engine.dispose()
    os.chmod(home / _JOB_STORE_DATABASE, 0o600)  # as the store creates it: jobs hold prompts
    return home


def seed_home(home: Path, job_store: bool = True, dagster: bool = True) -> None:
    """Give a new DAGSTER_HOME the databases its instance (with `dagster`: its SQLite storage, not where its
    config names another) and, with `job_store`, its job store at $DAGSTER_HOME/batch_jobs.db would create on
    first use, migrated to the same schema; any already there are kept."""
    names = (_DAGSTER_DATABASES if dagster else ()) + ((_JOB_STORE_DATABASE,) if job_store else ())
    for name in names:
        target = home / name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(_migrated_home() / name, target)


def write_instance_config(home: Path, max_concurrent_runs: int) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text(
        "run_coordinator:\n"
        "  module: dagster._core.run_coordinator\n"
        "  class: QueuedRunCoordinator\n"
        f"  config:\n    max_concurrent_runs: {max_concurrent_runs}\n    dequeue_interval_seconds: 1\n"
        "run_monitoring:\n  enabled: true\n  poll_interval_seconds: 5\n"
        "telemetry:\n  enabled: false\n"
    )


def sensor_resources(store_url: str, **others: object) -> dict[str, object]:
    """The resources the jobs sensor, the cleanup and keep_partial_results take, as the deployment binds them:
    this job store, the teams of the tenants file the test's API reads (BATCH_PIPELINE_TENANTS; none where
    unset), the deployment's launching bounds and admission policy; `others` replace any of them."""
    configured = settings()
    return {
        "job_store": JobStoreResource(url=store_url),
        "tenancy": Tenancy.of_deployment(configured),
        "run_launching": RunLaunching.of_deployment(configured),
        "admission": AdmissionPolicy.of_deployment(configured),
        **others,
    }


class Deployment:
    def __init__(
        self, home: Path, max_concurrent_runs: int, instance_yaml: str | None = None, jobs_db: str | None = None
    ) -> None:
        write_instance_config(home, max_concurrent_runs)
        if instance_yaml is not None:  # a shipped instance config instead of the test's SQLite one
            (home / "dagster.yaml").write_text(instance_yaml)
        self.home = home
        seed_home(home, job_store=jobs_db is None, dagster=instance_yaml is None)
        self.instance = dg.DagsterInstance.from_config(str(home))
        self.store = JobStore(jobs_db or f"sqlite:///{home}/batch_jobs.db")
        self.service = BatchJobService.of_deployment(settings(), self.store, self.instance)
        keys = ApiKeys([USER_KEY, OTHER_KEY, f"{ADMIN_KEY}:admin"])
        self.client = TestClient(create_app(self.service, keys))
        self.daemon: subprocess.Popen | None = None
        self.server = None

    def start_daemon(self) -> None:
        self.daemon = subprocess.Popen(
            [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", str(REPO / "workspace.yaml")],
            cwd=REPO,
            env={**os.environ},
            stdout=open(self.home / "daemon.log", "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def serve_http(self) -> str:
        """The same app on a real port (uvicorn in a thread), for clients in other processes; its URL."""
        import uvicorn

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.client.app, host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=self.server.run, daemon=True).start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the API did not start"
            time.sleep(0.05)
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.daemon and self.daemon.poll() is None:
            os.killpg(self.daemon.pid, signal.SIGTERM)
            try:
                self.daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.daemon.pid, signal.SIGKILL)
        self.client.close()
        self.instance.dispose()

    def job(self, job_id: str, key: str = USER_KEY) -> dict:
        response = self.client.get(f"/v2/batch-completions/{job_id}", headers={"x-api-key": key})
        assert response.status_code == 200, response.text
        return response.json()["job"]

    def finished_run(self, run_id: str, timeout: float = 60) -> dg.DagsterRun:
        """The run once Dagster has recorded its end (a run's op can record what it did a moment before)."""
        deadline = time.monotonic() + timeout
        while not (run := self.instance.get_run_by_id(run_id)).is_finished:
            assert time.monotonic() < deadline, f"run {run_id} still {run.status}"
            time.sleep(0.2)
        return run

    def wait_for(self, job_id: str, predicate, timeout: float = 300, key: str = USER_KEY) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id, key)
            if predicate(job):
                return job
            if time.monotonic() > deadline:
                log = (self.home / "daemon.log").read_text()[-4000:] if (self.home / "daemon.log").exists() else ""
                raise AssertionError(f"timed out; last state {job}\ndaemon log tail:\n{log}")
            time.sleep(0.5)


@pytest.fixture
def deployment_factory(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCH_PIPELINE_SENSOR_INTERVAL_S", "1")
    created = []

    def make(max_concurrent_runs: int = 1) -> Deployment:
        home = tmp_path / f"dagster_home_{len(created)}"
        monkeypatch.setenv("DAGSTER_HOME", str(home))
        monkeypatch.setenv("BATCH_PIPELINE_JOBS_DB", f"sqlite:///{home}/batch_jobs.db")
        deployment = Deployment(home, max_concurrent_runs)
        created.append(deployment)
        return deployment

    yield make
    for deployment in created:
        deployment.stop()


@pytest.fixture
def tenants_api(tmp_path, monkeypatch):
    """The real app over the job store and Dagster instance of a fresh DAGSTER_HOME, its keys read from
    the tenants file BATCH_PIPELINE_TENANTS names, as a deployment reads them (set it before using this)."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("BATCH_PIPELINE_JOBS_DB", f"sqlite:///{home}/batch_jobs.db")
    seed_home(home)
    instance = dg.DagsterInstance.from_config(str(home))
    service = BatchJobService.of_deployment(settings(), JobStore(f"sqlite:///{home}/batch_jobs.db"), instance)
    with TestClient(create_app(service)) as client:
        yield client
    instance.dispose()
