"""Each process gets only its own secrets: the shard workers the local launcher starts (or `batch-pipeline
run` starts ahead) and the dry run's checking process get an environment built from an allow-list
(core/environment.py), read here from the kernel's copy (/proc/<pid>/environ) of the real processes, with
a webhook secret, API keys and a database password in the service's environment."""

import dataclasses
import os
import signal
import stat
import tempfile
import threading
import time
from pathlib import Path

import dagster as dg
import pytest

from batch_pipeline.launch.local import LocalShardLauncher, worker_log_path
from batch_pipeline.launch.standby import StartedStandby
from batch_pipeline.shards.planning import write_shards
from batch_pipeline.shards.protocol import STANDBY_DIR_ENV, ShardTask
from batch_pipeline.shards.records import work_items

# What the service's own environment may hold, and none of its children may.
SECRETS = {
    "TEAM_A_WEBHOOK_SECRET": "whsec_team-a-secret-value",  # a tenants file's `secret_env`
    "BATCH_PIPELINE_API_KEYS": "sk-team-a-key,sk-admin-key:admin",
    "BATCH_PIPELINE_JOBS_DB": "postgresql://batch:db-password-value@db/batch",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-value",  # only for a process that reads s3:// data
}
# What a worker needs and gets.
KEPT = {"OMP_NUM_THREADS": "1", "BATCH_PIPELINE_SANDBOX_ALLOW_NETWORK": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture
def service_environment(monkeypatch, tmp_path):
    for name, value in {**SECRETS, **KEPT}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(STANDBY_DIR_ENV, raising=False)


def environ_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if entry)


def assert_no_secret(environment: dict[str, str]) -> None:
    leaked = {name for name, value in environment.items() for secret in SECRETS.values() if secret in value}
    assert not leaked, f"secrets reached the child: {sorted(leaked)}"
    assert not set(SECRETS) & set(environment)


def test_a_standby_worker_gets_no_secret(service_environment, monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    standby = StartedStandby.start()
    try:
        environment = environ_of(standby.process.pid)
    finally:
        standby.stop()
    assert_no_secret(environment)
    assert {name: environment.get(name) for name in KEPT} == KEPT
    assert environment["PATH"] == os.environ["PATH"]


# Stands in for the worker's program only: the real launcher starts it in the worker's environment, and it
# writes that environment, as the kernel holds it, where the test reads it.
RECORDING_PYTHON = """#!/bin/sh
cp /proc/$$/environ {record}
exit 3
"""


def shard_task(directory: Path) -> ShardTask:
    (shard,) = write_shards(
        work_items([("content", {"prompts": ["x"], "max_new_tokens": 4, "temperature": 0.0})]), 1, str(directory)
    )
    return ShardTask(shard=shard, model_config={"model": "no-such-model"})


@pytest.mark.parametrize("work_dir", ["local", "s3://batch/work"])
def test_the_local_launchers_worker_gets_no_secret(service_environment, tmp_path, work_dir):
    """A shard on local files gets no object store's credentials either; one whose checkpoint model is on
    S3 gets them, and still no other secret."""
    record = tmp_path / "environ"
    python = tmp_path / "python"
    python.write_text(RECORDING_PYTHON.format(record=record))
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    task = shard_task(tmp_path / "job")
    if work_dir != "local":
        task = ShardTask(shard=task.shard, model_config={"model": "m", "checkpoint_path": "s3://batch/models/m"})
    launcher = LocalShardLauncher(python_executable=str(python))

    @dg.op
    def launch_shard(context: dg.OpExecutionContext) -> None:
        launcher.run_shard(context, task)

    @dg.job
    def one_shard() -> None:
        launch_shard()

    result = one_shard.execute_in_process(raise_on_error=False)
    assert not result.success  # the stand-in exits 3
    environment = dict(
        entry.split("=", 1) for entry in record.read_bytes().decode().split("\0") if entry and "=" in entry
    )
    reads_s3 = work_dir != "local"
    if reads_s3:
        assert environment.pop("AWS_SECRET_ACCESS_KEY") == SECRETS["AWS_SECRET_ACCESS_KEY"]
    assert_no_secret(environment)
    assert environment["BATCH_PIPELINE_SANDBOX_ALLOW_NETWORK"] == "1" and environment["HF_HUB_OFFLINE"] == "1"
    assert any(name.startswith("DAGSTER_PIPES_") for name in environment)  # the Pipes bootstrap


# A chat template that renders for as long as the dry run lets it: its checking process stays to be read.
TEMPLATE_WITHOUT_END = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"


def children_of(pid: int) -> list[int]:
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(child) for child in (task / "children").read_text().split()]
    except FileNotFoundError:  # it has exited
        return []
    return found


@pytest.mark.slow  # the checking processes' server imports vLLM (~10 s)
def test_the_dry_runs_checking_process_gets_no_secret(service_environment, deployment_factory, monkeypatch, tmp_path):
    from batch_pipeline.dry_run.child import ChildServer
    from tests.api_fixtures import USER_KEY
    from tests.conftest import MODEL

    monkeypatch.setenv("BATCH_PIPELINE_DRY_RUN_TIMEOUT_S", "120")
    if ChildServer._running is not None:  # one started by an earlier test, in that test's environment
        ChildServer._running.process.kill()
        ChildServer._running.process.wait()
        ChildServer._running = None  # else the loop below reads the dead one's children
    api = deployment_factory()
    body = {
        "output_data_path": str(tmp_path / "out" / "output.json"),
        "model_config": {"model": MODEL},
        "content": [
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "chat_template": TEMPLATE_WITHOUT_END}
        ],
    }
    answers: list = []
    asking = threading.Thread(
        target=lambda: answers.append(
            api.client.post(
                "/v2/batch-completions", params={"dry_run": "true"}, json=body, headers={"x-api-key": USER_KEY}
            )
        )
    )
    asking.start()
    try:
        deadline = time.monotonic() + 240
        while not (ChildServer._running and children_of(ChildServer._running.process.pid)):
            assert time.monotonic() < deadline and asking.is_alive(), answers
            time.sleep(0.2)
        server = ChildServer._running.process.pid
        (checking,) = children_of(server)
        environments = {"the server": environ_of(server), "the checking process": environ_of(checking)}
    finally:
        if ChildServer._running is not None:
            for child in children_of(ChildServer._running.process.pid):
                os.kill(child, signal.SIGKILL)  # the dry run then ends at once, without an answer
        asking.join(timeout=60)
    for environment in environments.values():
        environment.pop("AWS_SECRET_ACCESS_KEY")  # it reads the request's s3:// paths as the API would
        assert_no_secret(environment)
        assert environment["HF_HUB_OFFLINE"] == "1"
    assert answers and answers[0].status_code == 422, answers


def test_a_shard_pod_gets_the_workers_settings_and_no_secret(service_environment, monkeypatch, tmp_path):
    """The Kubernetes launcher the deployment builds: the pod's environment is its `env` (and the Pipes
    bootstrap), and no Secret is mounted into it."""
    from batch_pipeline.pipeline.definitions import shard_launcher_from_environment

    monkeypatch.setenv("BATCH_PIPELINE_SHARD_LAUNCHER", "k8s")
    monkeypatch.setenv("BATCH_PIPELINE_WORKER_IMAGE", "batch-pipeline-worker:test")
    launcher = shard_launcher_from_environment()
    assert launcher.env == {"BATCH_PIPELINE_SANDBOX_ALLOW_NETWORK": "1"}  # the operator's opt-in reaches the pod
    task = shard_task(tmp_path / "job")
    _, spec = launcher.pod_overrides(
        ShardTask(shard=task.shard, model_config=task.model_config, tool_config={"name": "code_evaluator"})
    )
    (container,) = spec["containers"]
    assert "envFrom" not in container
    assert_no_secret({entry["name"]: entry.get("value", "") for entry in container.get("env", [])})


def test_a_remote_shards_worker_log_is_in_a_directory_only_the_services_user_enters(tmp_path, monkeypatch):
    """With the work dir on S3 the worker's log (a team's prompts and errors) goes to the temporary directory:
    never readable there by another local account, nor at a name it could plant a link at."""
    shared = tmp_path / "tmp"  # as /tmp is: every account writes there
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    local = shard_task(tmp_path / "job")
    task = ShardTask(
        shard=dataclasses.replace(local.shard, directory="s3://batch/work/job/shard_000"),
        model_config={"model": "m"},
        job_id="batch-abc",
    )
    log = Path(worker_log_path(task))
    assert log.parent.stat().st_uid == os.geteuid() and log.parent.stat().st_mode & 0o777 == 0o700
    # A directory of that name someone else left open (or a link) is not used: a fresh private one is.
    log.parent.chmod(0o777)
    other = Path(worker_log_path(task))
    assert other.parent != log.parent and other.parent.stat().st_mode & 0o777 == 0o700
