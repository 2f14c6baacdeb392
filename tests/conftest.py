import json
import os
from pathlib import Path

import dagster as dg
import pytest

from batch_pipeline.contract import CreateBatchCompletionsV2Request
from batch_pipeline.pipeline import step_server
from batch_pipeline.pipeline.execute import execute_request

MODEL = "smollm2-135m-instruct"
pytest_plugins = ["tests.api_fixtures"]

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# Each test's job runs in the shards it asks for: the jobs are small, and what many tests check spans shards.
# How a job's shard count is planned has tests of its own (test_shard_planning.py).
os.environ.setdefault("BATCH_PIPELINE_MIN_SHARD_TOKENS", "0")
os.environ.setdefault("BATCH_PIPELINE_MAX_SHARDS_PER_JOB", "64")
# Many tests run the same greedy job twice in one deployment to check what its second run generates (a resume,
# a warm engine, a dry run's history): the result cache would answer it instead. Its own tests turn it on
# (tests/pipeline/test_result_cache_e2e.py, and those of its quota and routes); users get it on by default.
os.environ.setdefault("BATCH_PIPELINE_RESULT_CACHE", "0")


@pytest.fixture(autouse=True)
def fresh_step_server():
    """The local executor forks step processes from a server that keeps the environment it started with;
    stopping it after each test lets the next test's runs see that test's DAGSTER_HOME and variables."""
    yield
    step_server.stop()


@pytest.fixture
def dagster_home(tmp_path, monkeypatch):
    """A real, persistent Dagster instance of its own (SQLite in a temporary DAGSTER_HOME)."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.delenv("BATCH_PIPELINE_WORK_DIR", raising=False)
    from tests.api_fixtures import seed_home  # here: pytest_plugins imports it first, rewriting its asserts

    seed_home(home)
    with dg.instance_for_test(temp_dir=str(home)) as instance:
        yield instance


@pytest.fixture
def run_job(dagster_home):
    """Run a request (a dict as a client would send it) through the real `batch_completions` job."""

    def run(body: dict, job_id: str | None = None) -> dg.JobExecutionResult:
        request = CreateBatchCompletionsV2Request.model_validate(body)
        return execute_request(request, dagster_home, job_id=job_id)

    return run


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from batch_pipeline.models.catalog import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(MODEL))


def step_failure_messages(result: dg.JobExecutionResult) -> list[str]:
    return [
        event.step_failure_data.error.message
        for event in result.all_events
        if event.is_step_failure and event.step_failure_data.error
    ]


def worker_pids() -> list[int]:
    """Processes of shard workers (`python -m batch_pipeline.worker`) of this test's deployment: those whose
    shard lies under this process's DAGSTER_HOME, where it has one (a soak or another checkout's tests may run
    beside). A worker's environment holds only its allow-list (core/environment.py), not DAGSTER_HOME: its
    Pipes context (DAGSTER_PIPES_CONTEXT) names its shard."""
    from dagster_pipes import decode_env_var

    home = os.environ.get("DAGSTER_HOME")
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if b"batch_pipeline.worker" not in Path(f"/proc/{entry}/cmdline").read_bytes():
                    continue
                if home is None:
                    pids.append(int(entry))
                    continue
                for variable in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    name, _, value = variable.partition(b"=")
                    if name == b"DAGSTER_PIPES_CONTEXT" and home in json.dumps(decode_env_var(value.decode())):
                        pids.append(int(entry))
            except (OSError, ValueError):
                pass
    return pids


def sandbox_processes() -> list[int]:
    """Live processes of any code_evaluator sandbox uid (a killed one may linger as a zombie until init reaps it)."""
    from batch_pipeline.worker.sandbox import SANDBOX_UID_BASE, processes_of

    return [pid for uid in range(SANDBOX_UID_BASE, SANDBOX_UID_BASE + 64) for pid in processes_of(uid)]
